//! A TCP forwarder for tests that start a client while its server is unreachable: it reserves a
//! local port on which connections are refused until [`Forwarder::open`] starts forwarding them
//! to the real server; [`Forwarder::close`] cuts every forwarded connection and refuses again
//! (a server outage as the client sees it).

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A local port that refuses connections, then forwards them to a target once opened.
#[derive(Debug)]
pub struct Forwarder {
    addr: SocketAddr,
    task: Option<JoinHandle<()>>,
    cut: CancellationToken,
}

impl Forwarder {
    /// Reserves a free local port and leaves it closed (connections are refused).
    pub async fn closed() -> std::io::Result<Self> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        drop(l);
        Ok(Self {
            addr,
            task: None,
            cut: CancellationToken::new(),
        })
    }

    /// The local address (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts accepting on the port and forwarding each connection to `target` (`host:port`).
    pub async fn open(&mut self, target: String) -> std::io::Result<()> {
        let l = TcpListener::bind(self.addr).await?;
        let cut = CancellationToken::new();
        self.cut = cut.clone();
        self.task = Some(tokio::spawn(async move {
            while let Ok((mut inbound, _)) = l.accept().await {
                let (target, cut) = (target.clone(), cut.clone());
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.cancelled() => {}
                        }
                    }
                });
            }
        }));
        Ok(())
    }

    /// Cuts every forwarded connection and refuses new ones until [`open`](Self::open) again.
    pub async fn close(&mut self) {
        self.cut.cancel();
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.cut.cancel();
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}
