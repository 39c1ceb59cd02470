//! LISTEN/NOTIFY wake-ups for relays, on sqlx's [`PgListener`].
//!
//! A writer built with `notify(true)` ([`crate::PgOutboxWriter::notify`]) sends a notification
//! on the table's channel ([`TableName::notify_channel`]) inside the caller's transaction, so
//! PostgreSQL delivers it at commit and never for a rolled-back write. A [`WakeListener`]
//! LISTENs on that channel on a connection of its own and wakes relays (`Relay::waker()`), which
//! then start a cycle at once instead of waiting for their poll interval.
//!
//! When the listening connection is lost (server restart, `pg_terminate_backend`), the listener
//! connects again with a back-off (100 ms doubling to 5 s) and, once LISTEN is back, wakes every
//! relay once: notifications sent meanwhile are lost, and the extra cycle picks up their rows.
//! Until then the relays poll. Checked by this crate's `tests/listen.rs`.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::error::Error;
use crate::sql::TableName;

/// First wait before connecting the listener again; it doubles up to [`RECONNECT_MAX`].
pub const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to connect the listener again.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// A task that wakes relays on each notification of an outbox table's channel. Dropping it
/// stops the task.
#[derive(Debug)]
pub struct WakeListener {
    task: JoinHandle<()>,
    channel: String,
}

impl WakeListener {
    /// LISTENs on the channel of `table` on a connection of `pool`'s settings (not one of its
    /// pooled connections) and wakes every waker on each notification. Returns once LISTEN is in
    /// place, so a notification committed after this returns is seen; fails when the first
    /// connection or LISTEN fails.
    pub async fn spawn(
        pool: &PgPool,
        table: &TableName,
        wakers: Vec<Arc<Notify>>,
    ) -> Result<Self, Error> {
        let channel = table.notify_channel();
        let listener = listen(pool, &channel).await.map_err(|e| Error::Database {
            during: "LISTEN on the outbox table's channel",
            message: e.to_string(),
        })?;
        tracing::debug!(%channel, "listening for wake-ups");
        let task = tokio::spawn(run(listener, pool.clone(), channel.clone(), wakers));
        Ok(Self { task, channel })
    }

    /// The channel listened on.
    pub fn channel(&self) -> &str {
        &self.channel
    }
}

impl Drop for WakeListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn listen(pool: &PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut l = PgListener::connect_with(pool).await?;
    l.listen(channel).await?;
    Ok(l)
}

fn wake_all(wakers: &[Arc<Notify>]) {
    wakers.iter().for_each(|w| w.notify_one());
}

async fn run(mut l: PgListener, pool: PgPool, channel: String, wakers: Vec<Arc<Notify>>) {
    loop {
        match l.try_recv().await {
            Ok(Some(_)) => {
                wake_all(&wakers);
                continue;
            }
            Ok(None) => {
                tracing::warn!(%channel, "LISTEN connection lost; reconnecting (the relays poll meanwhile)");
            }
            Err(e) => {
                tracing::warn!(%channel, error = %e, "LISTEN connection failed; reconnecting (the relays poll meanwhile)");
            }
        }
        drop(l);
        let mut wait = RECONNECT_MIN;
        l = loop {
            match listen(&pool, &channel).await {
                Ok(l) => break l,
                Err(e) => {
                    tracing::debug!(%channel, error = %e, retry_in = ?wait, "LISTEN reconnect failed");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(RECONNECT_MAX);
                }
            }
        };
        tracing::info!(%channel, "LISTEN connection back; waking the relays once for what was missed");
        wake_all(&wakers);
    }
}
