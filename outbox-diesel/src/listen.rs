//! LISTEN/NOTIFY wake-ups for relays, on diesel-async's notification stream (no sqlx).
//!
//! A writer built with `notify(true)` ([`crate::DieselOutboxWriter::notify`]) sends a
//! notification on the table's channel ([`TableName::notify_channel`]) inside the caller's
//! transaction, so PostgreSQL delivers it at commit and never for a rolled-back write. A
//! [`WakeListener`] LISTENs on that channel on a connection of its own
//! ([`AsyncPgConnection::notifications_stream`]) and wakes relays (`Relay::waker()`), which then
//! start a cycle at once instead of waiting for their poll interval.
//!
//! When the listening connection is lost (server restart, `pg_terminate_backend`), the listener
//! connects again with a back-off (100 ms doubling to 5 s) and, once LISTEN is back, wakes every
//! relay once: notifications sent meanwhile are lost, and the extra cycle picks up their rows.
//! Until then the relays poll. Checked by this crate's `tests/listen.rs`.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::error::Error;
use outbox_postgres::sql::TableName;

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
    /// Connects to `database_url` (a connection of its own, outside any pool), LISTENs on the
    /// channel of `table` and wakes every waker on each notification. Returns once LISTEN is in
    /// place, so a notification committed after this returns is seen; fails when the first
    /// connection or LISTEN fails.
    pub async fn spawn(
        database_url: &str,
        table: &TableName,
        wakers: Vec<Arc<Notify>>,
    ) -> Result<Self, Error> {
        let channel = table.notify_channel();
        let conn = listen(database_url, &channel)
            .await
            .map_err(|e| Error::Listen {
                channel: channel.clone(),
                message: e,
            })?;
        tracing::debug!(%channel, "listening for wake-ups");
        let task = tokio::spawn(run(conn, database_url.to_owned(), channel.clone(), wakers));
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

/// `LISTEN "<channel>"`: the channel comes from a validated [`TableName`] (lowercase letters,
/// digits, `_` and `.`), and any `"` would be doubled.
fn listen_sql(channel: &str) -> String {
    format!("LISTEN \"{}\"", channel.replace('"', "\"\""))
}

async fn listen(url: &str, channel: &str) -> Result<AsyncPgConnection, String> {
    let mut conn = AsyncPgConnection::establish(url)
        .await
        .map_err(|e| e.to_string())?;
    diesel::sql_query(listen_sql(channel))
        .execute(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(conn)
}

fn wake_all(wakers: &[Arc<Notify>]) {
    wakers.iter().for_each(|w| w.notify_one());
}

async fn run(mut conn: AsyncPgConnection, url: String, channel: String, wakers: Vec<Arc<Notify>>) {
    loop {
        {
            let mut stream = std::pin::pin!(conn.notifications_stream());
            loop {
                match stream.next().await {
                    Some(Ok(_)) => wake_all(&wakers),
                    Some(Err(e)) => {
                        tracing::warn!(%channel, error = %e, "LISTEN connection failed; reconnecting (the relays poll meanwhile)");
                        break;
                    }
                    None => {
                        tracing::warn!(%channel, "LISTEN connection lost; reconnecting (the relays poll meanwhile)");
                        break;
                    }
                }
            }
        }
        drop(conn);
        let mut wait = RECONNECT_MIN;
        conn = loop {
            match listen(&url, &channel).await {
                Ok(c) => break c,
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
