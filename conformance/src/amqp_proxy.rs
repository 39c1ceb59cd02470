//! A loopback proxy that reads AMQP 0-9-1 framing (brokers.md section 4.1, "Proxy"), for the
//! RabbitMQ inbox scenarios J-23, J-24 and J-33.
//!
//! It forwards every byte, and records the basic.deliver frames from the broker and the
//! basic.ack, basic.nack and basic.reject frames from the client (channel, delivery tag, flags,
//! time). In mode [`Mode::DropAcks`] it discards basic.ack frames from the client to the broker
//! (`drop(basic.ack, client to broker)`), and [`AmqpProxy::cut`] closes every connection through
//! it (`cut`) and every later one.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// What the proxy does with the frames it passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Everything passes.
    Forward,
    /// basic.ack frames from the client are discarded; the rest passes.
    DropAcks,
}

/// One recorded method frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// `basic.deliver` (broker to client), `basic.ack`, `basic.nack` or `basic.reject` (client to
    /// broker).
    pub method: &'static str,
    /// The channel.
    pub channel: u16,
    /// The delivery tag.
    pub tag: u64,
    /// basic.deliver: redelivered; basic.nack and basic.reject: requeue.
    pub flag: bool,
    /// Whether the proxy discarded it.
    pub dropped: bool,
    /// When it passed.
    pub at: tokio::time::Instant,
}

struct State {
    mode: Mutex<Mode>,
    frames: Mutex<Vec<Frame>>,
    version: Mutex<Option<String>>,
    cut: CancellationToken,
}

/// The proxy; dropping it stops it.
pub struct AmqpProxy {
    addr: SocketAddr,
    state: Arc<State>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for AmqpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.state.cut.cancel();
    }
}

impl AmqpProxy {
    /// Listens on a free loopback port and forwards to `upstream`, in `mode`.
    pub async fn start(upstream: SocketAddr, mode: Mode) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let state = Arc::new(State {
            mode: Mutex::new(mode),
            frames: Mutex::default(),
            version: Mutex::default(),
            cut: CancellationToken::new(),
        });
        let st = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if st.cut.is_cancelled() {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let (a, b) = (st.clone(), st.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = pump(cr, sw, a.clone(), true) => {}
                        _ = a.cut.cancelled() => {}
                    }
                });
                tokio::spawn(async move {
                    tokio::select! {
                        _ = pump(sr, cw, b.clone(), false) => {}
                        _ = b.cut.cancelled() => {}
                    }
                });
            }
        });
        Self {
            addr,
            state,
            accept,
        }
    }

    /// The address to connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Switches the mode.
    pub fn set_mode(&self, m: Mode) {
        *self.state.mode.lock().expect("mode") = m;
    }

    /// Closes every connection through the proxy, and every later one.
    pub fn cut(&self) {
        self.state.cut.cancel();
    }

    /// The frames recorded so far.
    pub fn frames(&self) -> Vec<Frame> {
        self.state.frames.lock().expect("frames").clone()
    }

    /// The broker's version, from the `version` server property of the first connection.start
    /// that passed.
    pub fn server_version(&self) -> Option<String> {
        self.state.version.lock().expect("version").clone()
    }

    /// The recorded frames of one method.
    pub fn frames_of(&self, method: &str) -> Vec<Frame> {
        self.frames()
            .into_iter()
            .filter(|f| f.method == method)
            .collect()
    }
}

/// Copies one direction frame by frame, recording (and in DropAcks mode discarding) the
/// methods above. The client's direction starts with the 8-byte protocol header.
async fn pump<R, W>(mut r: R, mut w: W, st: Arc<State>, from_client: bool)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if from_client {
        let mut header = [0u8; 8];
        if r.read_exact(&mut header).await.is_err() || w.write_all(&header).await.is_err() {
            return;
        }
    }
    loop {
        let mut head = [0u8; 7];
        if r.read_exact(&mut head).await.is_err() {
            return;
        }
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut rest = vec![0u8; size + 1];
        if r.read_exact(&mut rest).await.is_err() {
            return;
        }
        let channel = u16::from_be_bytes([head[1], head[2]]);
        let mut drop_it = false;
        if head[0] == 1 && !from_client && rest.starts_with(&[0, 10, 0, 10]) {
            let mut v = st.version.lock().expect("version");
            if v.is_none() {
                *v = server_version(&rest[..size]);
            }
        }
        if head[0] == 1
            && let Some(mut f) = method(&rest[..size], channel, from_client)
        {
            drop_it = from_client
                && f.method == "basic.ack"
                && *st.mode.lock().expect("mode") == Mode::DropAcks;
            f.dropped = drop_it;
            st.frames.lock().expect("frames").push(f);
        }
        if drop_it {
            continue;
        }
        if w.write_all(&head).await.is_err() || w.write_all(&rest).await.is_err() {
            return;
        }
    }
}

/// The `version` long string of connection.start's server properties.
fn server_version(p: &[u8]) -> Option<String> {
    let key = b"\x07versionS";
    let at = p.windows(key.len()).position(|w| w == key)? + key.len();
    let len = u32::from_be_bytes(p.get(at..at + 4)?.try_into().ok()?) as usize;
    String::from_utf8(p.get(at + 4..at + 4 + len)?.to_vec()).ok()
}

/// Reads the methods the proxy records from a method frame's payload.
fn method(p: &[u8], channel: u16, from_client: bool) -> Option<Frame> {
    if p.len() < 4 || u16::from_be_bytes([p[0], p[1]]) != 60 {
        return None;
    }
    let id = u16::from_be_bytes([p[2], p[3]]);
    let u64_at = |i: usize| -> Option<u64> {
        p.get(i..i + 8)
            .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
    };
    let frame = |method, tag, flag| Frame {
        method,
        channel,
        tag,
        flag,
        dropped: false,
        at: tokio::time::Instant::now(),
    };
    match (from_client, id) {
        // basic.deliver: consumer-tag (short string), delivery-tag, redelivered bit.
        (false, 60) => {
            let n = usize::from(*p.get(4)?);
            let tag = u64_at(5 + n)?;
            let bits = *p.get(13 + n)?;
            Some(frame("basic.deliver", tag, bits & 1 == 1))
        }
        (true, 80) => Some(frame("basic.ack", u64_at(4)?, false)),
        (true, 90) => Some(frame("basic.reject", u64_at(4)?, *p.get(12)? & 1 == 1)),
        (true, 120) => Some(frame("basic.nack", u64_at(4)?, *p.get(12)? & 2 == 2)),
        _ => None,
    }
}
