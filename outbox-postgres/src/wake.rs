//! The wake-up listener's reconnect logic, shared by the drivers: a task that LISTENs on an
//! outbox table's channel and wakes relays on each notification. Each driver supplies its
//! half ([`WakeSource`]: connect and LISTEN, then wait for notifications); this module owns
//! the loop.
//!
//! When the listening connection is lost (server restart, `pg_terminate_backend`), the listener
//! connects again with a back-off ([`RECONNECT_MIN`] doubling to [`RECONNECT_MAX`]) and, once
//! LISTEN is back, wakes every relay once: notifications sent meanwhile are lost, and the extra
//! cycle picks up their rows. Until then the relays poll.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// First wait before connecting the listener again; it doubles up to [`RECONNECT_MAX`].
pub const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to connect the listener again.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// A driver's half of the listener (semver-exempt, like [`crate::driver`]).
#[async_trait]
pub trait WakeSource: Send + Sync + 'static {
    /// A connection LISTENing on the channel.
    type Conn: Send;

    /// Connects (a connection of its own, outside any pool) and LISTENs on `channel`.
    async fn listen(&self, channel: &str) -> Result<Self::Conn, String>;

    /// Calls `wake` on each notification until the connection is lost; returns `None` when it
    /// closed, or the error that ended it.
    async fn until_lost(&self, conn: &mut Self::Conn, wake: &(dyn Fn() + Sync)) -> Option<String>;
}

/// The running listener task; dropping it stops the task.
#[derive(Debug)]
pub struct Listening {
    task: JoinHandle<()>,
    channel: String,
}

impl Listening {
    /// Connects and LISTENs on `channel` with `source`, then runs the loop in a task. Returns
    /// once LISTEN is in place, so a notification committed after this returns is seen; fails
    /// with the driver's message when the first connection or LISTEN fails.
    pub async fn spawn<S: WakeSource>(
        source: S,
        channel: String,
        wakers: Vec<Arc<Notify>>,
    ) -> Result<Self, String> {
        let conn = source.listen(&channel).await?;
        tracing::debug!(%channel, "listening for wake-ups");
        let task = tokio::spawn(run(source, conn, channel.clone(), wakers));
        Ok(Self { task, channel })
    }

    /// The channel listened on.
    pub fn channel(&self) -> &str {
        &self.channel
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run<S: WakeSource>(
    source: S,
    mut conn: S::Conn,
    channel: String,
    wakers: Vec<Arc<Notify>>,
) {
    let wake_all = || wakers.iter().for_each(|w| w.notify_one());
    loop {
        match source.until_lost(&mut conn, &wake_all).await {
            None => {
                tracing::warn!(%channel, "LISTEN connection lost; reconnecting (the relays poll meanwhile)");
            }
            Some(e) => {
                tracing::warn!(%channel, error = %e, "LISTEN connection failed; reconnecting (the relays poll meanwhile)");
            }
        }
        drop(conn);
        let mut wait = RECONNECT_MIN;
        conn = loop {
            match source.listen(&channel).await {
                Ok(c) => break c,
                Err(e) => {
                    tracing::debug!(%channel, error = %e, retry_in = ?wait, "LISTEN reconnect failed");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(RECONNECT_MAX);
                }
            }
        };
        tracing::info!(%channel, "LISTEN connection back; waking the relays once for what was missed");
        wake_all();
    }
}
