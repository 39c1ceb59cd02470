//! A TCP forwarder for tests that start a client while its server is unreachable: it reserves a
//! local port on which connections are refused until [`Forwarder::open`] starts forwarding them
//! to the real server.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A local port that refuses connections, then forwards them to a target once opened.
#[derive(Debug)]
pub struct Forwarder {
    addr: SocketAddr,
    task: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Reserves a free local port and leaves it closed (connections are refused).
    pub async fn closed() -> std::io::Result<Self> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        drop(l);
        Ok(Self { addr, task: None })
    }

    /// The local address (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts accepting on the port and forwarding each connection to `target` (`host:port`).
    pub async fn open(&mut self, target: String) -> std::io::Result<()> {
        let l = TcpListener::bind(self.addr).await?;
        self.task = Some(tokio::spawn(async move {
            while let Ok((mut inbound, _)) = l.accept().await {
                let target = target.clone();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
        Ok(())
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}
