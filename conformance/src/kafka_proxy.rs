//! A loopback proxy that reads Kafka's framing (size-prefixed requests and answers) for K-15:
//! it forwards everything, except that it discards the broker's answer to the first Produce
//! request (API key 0) and then closes that connection, so the client resends the batch.
//!
//! A Kafka client connects to the address the broker advertises, so the broker behind this proxy
//! must advertise the proxy's address ([`KafkaUnderTest::private_broker`](crate::kafka::KafkaUnderTest::private_broker)).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// The Produce request's API key.
pub const PRODUCE: i16 = 0;

/// The proxy; dropping it stops it.
pub struct DropFirstProduceAnswer {
    addr: SocketAddr,
    task: JoinHandle<()>,
    dropped: Arc<AtomicUsize>,
    produce_requests: Arc<AtomicUsize>,
}

impl DropFirstProduceAnswer {
    /// Binds a free loopback port (see [`addr`](Self::addr)); forwarding starts with
    /// [`forward_to`](Self::forward_to).
    pub async fn bind() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let a = l.local_addr().expect("addr");
        (l, a)
    }

    /// Forwards connections accepted on `listener` to `upstream`.
    pub fn forward_to(listener: TcpListener, upstream: SocketAddr) -> Self {
        let addr = listener.local_addr().expect("addr");
        let armed = Arc::new(AtomicBool::new(true));
        let dropped = Arc::new(AtomicUsize::new(0));
        let produce_requests = Arc::new(AtomicUsize::new(0));
        let (d, p) = (dropped.clone(), produce_requests.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (armed, d, p) = (armed.clone(), d.clone(), p.clone());
                tokio::spawn(async move {
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    // The correlation id of the Produce request whose answer is to be dropped.
                    let target: Arc<Mutex<Option<i32>>> = Arc::new(Mutex::new(None));
                    let up = requests(cr, sw, target.clone(), armed, p);
                    let down = answers(sr, cw, target, d);
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                    }
                });
            }
        });
        Self {
            addr,
            task,
            dropped,
            produce_requests,
        }
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers discarded so far (0 or 1).
    pub fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }

    /// Produce requests seen so far.
    pub fn produce_requests(&self) -> usize {
        self.produce_requests.load(Ordering::SeqCst)
    }
}

impl Drop for DropFirstProduceAnswer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn frame(r: &mut OwnedReadHalf) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await.ok()?;
    let n = i32::from_be_bytes(len);
    let n = usize::try_from(n).ok()?;
    let mut buf = vec![0u8; 4 + n];
    buf[..4].copy_from_slice(&len);
    r.read_exact(&mut buf[4..]).await.ok()?;
    Some(buf)
}

/// Client to broker: forwards each request; the first Produce request arms the drop.
async fn requests(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    target: Arc<Mutex<Option<i32>>>,
    armed: Arc<AtomicBool>,
    produce: Arc<AtomicUsize>,
) {
    while let Some(f) = frame(&mut r).await {
        if f.len() >= 12 {
            let api_key = i16::from_be_bytes([f[4], f[5]]);
            let correlation = i32::from_be_bytes([f[8], f[9], f[10], f[11]]);
            if api_key == PRODUCE {
                produce.fetch_add(1, Ordering::SeqCst);
                if armed.swap(false, Ordering::SeqCst) {
                    *target.lock().await = Some(correlation);
                }
            }
        }
        if w.write_all(&f).await.is_err() {
            return;
        }
    }
}

/// Broker to client: forwards each answer, except the armed one, after which the connection is
/// closed.
async fn answers(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    target: Arc<Mutex<Option<i32>>>,
    dropped: Arc<AtomicUsize>,
) {
    while let Some(f) = frame(&mut r).await {
        if f.len() >= 8 {
            let correlation = i32::from_be_bytes([f[4], f[5], f[6], f[7]]);
            if *target.lock().await == Some(correlation) {
                dropped.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        if w.write_all(&f).await.is_err() {
            return;
        }
    }
}
