//! A loopback proxy that reads Kafka's framing (size-prefixed requests and answers). For K-15
//! it forwards everything, except that it discards the broker's answer to the first Produce
//! request (API key 0) and then closes that connection, so the client resends the batch. In
//! [`Mode::RefuseInitProducerId`] it instead turns every InitProducerId answer (API key 22)
//! into `UNKNOWN_SERVER_ERROR`, making any broker one that grants no idempotent producer (the
//! setting of K-16, for brokers that do grant one).
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
/// The InitProducerId request's API key.
pub const INIT_PRODUCER_ID: i16 = 22;

/// What the proxy changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Discard the answer to the first Produce request and close that connection.
    DropFirstProduceAnswer,
    /// Answer every InitProducerId with error code -1 (UNKNOWN_SERVER_ERROR).
    RefuseInitProducerId,
    /// Forward everything until [`DropFirstProduceAnswer::set_dropping`] turns dropping on;
    /// then discard the requests with this API key (client to broker), unanswered (J-16's
    /// `drop(OffsetCommit request, client to broker)`).
    DropRequests(i16),
}

/// The OffsetCommit request's API key.
pub const OFFSET_COMMIT: i16 = 8;

/// The proxy; dropping it stops it.
pub struct DropFirstProduceAnswer {
    addr: SocketAddr,
    armed: Arc<AtomicBool>,
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

    /// Forwards connections accepted on `listener` to `upstream` (mode
    /// [`Mode::DropFirstProduceAnswer`]).
    pub fn forward_to(listener: TcpListener, upstream: SocketAddr) -> Self {
        Self::with_mode(listener, upstream, Mode::DropFirstProduceAnswer)
    }

    /// Forwards connections accepted on `listener` to `upstream` in `mode`.
    pub fn with_mode(listener: TcpListener, upstream: SocketAddr, mode: Mode) -> Self {
        let addr = listener.local_addr().expect("addr");
        let armed = Arc::new(AtomicBool::new(!matches!(mode, Mode::DropRequests(_))));
        let switch = armed.clone();
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
                    let state = Arc::new(Mutex::new(Conn::default()));
                    let up = requests(cr, sw, state.clone(), armed, p, mode);
                    let down = answers(sr, cw, state, d);
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                    }
                });
            }
        });
        Self {
            addr,
            armed: switch,
            task,
            dropped,
            produce_requests,
        }
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers discarded (or, refusing InitProducerId, rewritten) so far.
    pub fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }

    /// In [`Mode::DropRequests`]: whether requests of its API key are discarded from now on.
    pub fn set_dropping(&self, on: bool) {
        self.armed.store(on, Ordering::SeqCst);
    }

    /// Produce requests seen so far (in [`Mode::DropRequests`]: the requests discarded).
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

/// What one connection's answers need from its requests.
#[derive(Default)]
struct Conn {
    /// The correlation id of the Produce request whose answer is to be dropped.
    drop: Option<i32>,
    /// InitProducerId requests to refuse: correlation id and whether the answer is flexible
    /// (a tagged-field byte after the correlation id).
    refuse: Vec<(i32, bool)>,
}

/// Client to broker: forwards each request, noting those whose answers change.
async fn requests(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    state: Arc<Mutex<Conn>>,
    armed: Arc<AtomicBool>,
    produce: Arc<AtomicUsize>,
    mode: Mode,
) {
    while let Some(f) = frame(&mut r).await {
        if f.len() >= 12 {
            let api_key = i16::from_be_bytes([f[4], f[5]]);
            let version = i16::from_be_bytes([f[6], f[7]]);
            let correlation = i32::from_be_bytes([f[8], f[9], f[10], f[11]]);
            match (mode, api_key) {
                (Mode::DropFirstProduceAnswer, PRODUCE) => {
                    produce.fetch_add(1, Ordering::SeqCst);
                    if armed.swap(false, Ordering::SeqCst) {
                        state.lock().await.drop = Some(correlation);
                    }
                }
                (Mode::RefuseInitProducerId, INIT_PRODUCER_ID) => {
                    // InitProducerId is flexible from version 2.
                    state.lock().await.refuse.push((correlation, version >= 2));
                }
                (Mode::DropRequests(k), key) if k == key && armed.load(Ordering::SeqCst) => {
                    produce.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                _ => {}
            }
        }
        if w.write_all(&f).await.is_err() {
            return;
        }
    }
}

/// Broker to client: forwards each answer, except the one to drop (after which the connection
/// is closed), with refused InitProducerId answers rewritten.
async fn answers(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    state: Arc<Mutex<Conn>>,
    dropped: Arc<AtomicUsize>,
) {
    while let Some(mut f) = frame(&mut r).await {
        if f.len() >= 8 {
            let correlation = i32::from_be_bytes([f[4], f[5], f[6], f[7]]);
            let mut st = state.lock().await;
            if st.drop == Some(correlation) {
                dropped.fetch_add(1, Ordering::SeqCst);
                return;
            }
            if let Some(i) = st.refuse.iter().position(|(c, _)| *c == correlation) {
                let (_, flexible) = st.refuse.remove(i);
                // header: correlation id [+ tagged fields], then throttle_time_ms, error_code.
                let at = 8 + usize::from(flexible) + 4;
                if f.len() >= at + 2 {
                    f[at..at + 2].copy_from_slice(&(-1i16).to_be_bytes());
                    dropped.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        if w.write_all(&f).await.is_err() {
            return;
        }
    }
}
