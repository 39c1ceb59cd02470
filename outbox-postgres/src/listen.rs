//! LISTEN/NOTIFY wake-ups for relays, on sqlx's [`PgListener`].
//!
//! A writer built with `notify(true)` ([`crate::outbox::Writer::notify`]) sends a notification
//! on the table's channel ([`TableName::notify_channel`]) inside the caller's transaction, so
//! PostgreSQL delivers it at commit and never for a rolled-back write. A [`WakeListener`]
//! LISTENs on that channel on a connection of its own and wakes relays (`Relay::waker()`), which
//! then start a cycle at once instead of waiting for their poll interval. Reconnecting after a
//! lost connection, and the wake-up check (R196: a probe NOTIFY, a warning and fallback polling
//! when it does not arrive), are [`crate::wake`]'s. Checked by this crate's `tests/listen.rs`
//! and `tests/pooler.rs` (OP-09).

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;

use crate::driver::sqlx::SqlxDriver;
use crate::error::Error;
use crate::sql::TableName;
use crate::wake::{Listening, WakeSource};
pub use crate::wake::{RECONNECT_MAX, RECONNECT_MIN, WakeCheck, WakeOptions};

/// A task that wakes relays on each notification of an outbox table's channel. Dropping it
/// stops the task.
#[derive(Debug)]
pub struct WakeListener(Listening);

impl WakeListener {
    /// LISTENs on the channel of `table` on one of `pool`'s connections, held for as long as
    /// the listener runs (sqlx's `PgListener::connect_with` takes it from the pool: size the pool
    /// one above what the relays need), and wakes every waker on each notification; the wake-up
    /// check with its defaults. Returns once LISTEN is in place, so a notification committed
    /// after this returns is seen; fails when the first connection or LISTEN fails.
    pub async fn spawn(
        pool: &PgPool,
        table: &TableName,
        wakers: Vec<Arc<Notify>>,
    ) -> Result<Self, Error> {
        Self::spawn_with(pool, table, wakers, WakeOptions::default()).await
    }

    /// As [`WakeListener::spawn`], with `options`: with a `listen_url` (R195) the listener
    /// connects there on a connection of its own instead of taking one from `pool` (behind a
    /// transaction-pooling proxy, give a direct URL); the probe of the wake-up check runs in a
    /// transaction on `pool` in the options' pooler mode.
    ///
    /// Do not LISTEN through a transaction-pooling proxy: the notifications never reach the
    /// listener (the wake-up check says so, R196), and the server connection that LISTENed
    /// keeps receiving them while the proxy hands it to other clients, where sqlx fails the
    /// statement in flight (`unexpected message: NotificationResponse`; seen in OP-09).
    pub async fn spawn_with(
        pool: &PgPool,
        table: &TableName,
        wakers: Vec<Arc<Notify>>,
        options: WakeOptions,
    ) -> Result<Self, Error> {
        let source = match options.listen_url_ref() {
            Some(url) => SqlxSource::Url(url.to_owned()),
            None => SqlxSource::Pool(pool.clone()),
        };
        let probe = options.probe(SqlxDriver(pool.clone()), table);
        Listening::spawn(
            source,
            probe,
            table.notify_channel(),
            wakers,
            options.check_ref(),
        )
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

    /// What the wake-up check found (R196): `None` before the first probe's answer, then
    /// whether the last probe arrived.
    pub fn listener_ok(&self) -> Option<bool> {
        self.0.listener_ok()
    }
}

enum SqlxSource {
    Pool(PgPool),
    Url(String),
}

#[async_trait]
impl WakeSource for SqlxSource {
    type Conn = PgListener;

    async fn listen(&self, channel: &str) -> Result<PgListener, String> {
        let mut l = match self {
            SqlxSource::Pool(p) => PgListener::connect_with(p).await,
            SqlxSource::Url(u) => PgListener::connect(u).await,
        }
        .map_err(|e| e.to_string())?;
        l.listen(channel).await.map_err(|e| e.to_string())?;
        Ok(l)
    }

    async fn until_lost(
        &self,
        l: &mut PgListener,
        note: &(dyn for<'p> Fn(&'p str) + Sync),
    ) -> Option<String> {
        loop {
            match l.try_recv().await {
                Ok(Some(n)) => note(n.payload()),
                Ok(None) => return None,
                Err(e) => return Some(e.to_string()),
            }
        }
    }
}
