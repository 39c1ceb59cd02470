//! LISTEN/NOTIFY wake-ups for relays, on sqlx's [`PgListener`].
//!
//! A writer built with `notify(true)` ([`crate::outbox::Writer::notify`]) sends a notification
//! on the table's channel ([`TableName::notify_channel`]) inside the caller's transaction, so
//! PostgreSQL delivers it at commit and never for a rolled-back write. A [`WakeListener`]
//! LISTENs on that channel on a connection of its own and wakes relays (`Relay::waker()`), which
//! then start a cycle at once instead of waiting for their poll interval. Reconnecting after a
//! lost connection is [`crate::wake`]'s. Checked by this crate's `tests/listen.rs`.

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;

use crate::error::Error;
use crate::sql::TableName;
use crate::wake::{Listening, WakeSource};
pub use crate::wake::{RECONNECT_MAX, RECONNECT_MIN};

/// A task that wakes relays on each notification of an outbox table's channel. Dropping it
/// stops the task.
#[derive(Debug)]
pub struct WakeListener(Listening);

impl WakeListener {
    /// LISTENs on the channel of `table` on one of `pool`'s connections, held for as long as
    /// the listener runs (sqlx's `PgListener::connect_with` takes it from the pool: size the pool
    /// one above what the relays need), and wakes every waker on each notification. Returns once
    /// LISTEN is in place, so a notification committed after this returns is seen; fails when
    /// the first connection or LISTEN fails.
    pub async fn spawn(
        pool: &PgPool,
        table: &TableName,
        wakers: Vec<Arc<Notify>>,
    ) -> Result<Self, Error> {
        Listening::spawn(SqlxSource(pool.clone()), table.notify_channel(), wakers)
            .await
            .map(Self)
            .map_err(|message| Error::Database {
                during: "LISTEN on the outbox table's channel",
                message,
            })
    }

    /// The channel listened on.
    pub fn channel(&self) -> &str {
        self.0.channel()
    }
}

struct SqlxSource(PgPool);

#[async_trait]
impl WakeSource for SqlxSource {
    type Conn = PgListener;

    async fn listen(&self, channel: &str) -> Result<PgListener, String> {
        let mut l = PgListener::connect_with(&self.0)
            .await
            .map_err(|e| e.to_string())?;
        l.listen(channel).await.map_err(|e| e.to_string())?;
        Ok(l)
    }

    async fn until_lost(&self, l: &mut PgListener, wake: &(dyn Fn() + Sync)) -> Option<String> {
        loop {
            match l.try_recv().await {
                Ok(Some(_)) => wake(),
                Ok(None) => return None,
                Err(e) => return Some(e.to_string()),
            }
        }
    }
}
