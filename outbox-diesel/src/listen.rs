//! LISTEN/NOTIFY wake-ups for relays, on diesel-async's notification stream (no sqlx).
//!
//! A writer built with `notify(true)` ([`crate::DieselOutboxWriter::notify`]) sends a
//! notification on the table's channel ([`TableName::notify_channel`]) inside the caller's
//! transaction, so PostgreSQL delivers it at commit and never for a rolled-back write. A
//! [`WakeListener`] LISTENs on that channel on a connection of its own
//! ([`AsyncPgConnection::notifications_stream`]) and wakes relays (`Relay::waker()`), which then
//! start a cycle at once instead of waiting for their poll interval.
//!
//! Reconnecting after a lost connection is `txoutbox_postgres::wake`'s. Checked by this crate's
//! `tests/listen.rs`.

use std::sync::Arc;

use async_trait::async_trait;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures::StreamExt;
use tokio::sync::Notify;
use txoutbox_postgres::sql::TableName;
use txoutbox_postgres::wake::{Listening, WakeSource};
pub use txoutbox_postgres::wake::{RECONNECT_MAX, RECONNECT_MIN, WakeCheck, WakeOptions};

use crate::driver::DieselDriver;
use crate::error::Error;
use crate::pool::{PgPool, PoolSettings, build_pool};

/// A task that wakes relays on each notification of an outbox table's channel. Dropping it
/// stops the task.
#[derive(Debug)]
pub struct WakeListener(Listening);

impl WakeListener {
    /// Connects to `database_url` (a connection of its own, outside any pool), LISTENs on the
    /// channel of `table` and wakes every waker on each notification; the wake-up check (R196)
    /// with its defaults, its probe on a one-connection pool of the same URL. Returns once
    /// LISTEN is in place, so a notification committed after this returns is seen; fails when
    /// the first connection or LISTEN fails.
    pub async fn spawn(
        database_url: &str,
        table: &TableName,
        wakers: Vec<Arc<Notify>>,
    ) -> Result<Self, Error> {
        let pool = build_pool(database_url, &PoolSettings::default().max_size(1)?)?;
        Self::spawn_with(
            &pool,
            table,
            wakers,
            WakeOptions::default().listen_url(database_url),
        )
        .await
    }

    /// LISTENs on the channel of `table` on a connection of its own to the options'
    /// `listen_url` (R195; required: a direct URL when `pool` goes through a
    /// transaction-pooling proxy), and runs the wake-up check's probe in a transaction on
    /// `pool` in the options' pooler mode.
    pub async fn spawn_with(
        pool: &PgPool,
        table: &TableName,
        wakers: Vec<Arc<Notify>>,
        options: WakeOptions,
    ) -> Result<Self, Error> {
        let channel = table.notify_channel();
        let Some(url) = options.listen_url_ref() else {
            return Err(Error::Config(format!(
                "the wake-up listener of {channel} needs a URL to LISTEN on: set WakeOptions::listen_url (a direct URL, not a transaction-pooling proxy)"
            )));
        };
        let probe = options.probe(DieselDriver(pool.clone()), table);
        Listening::spawn(
            DieselSource(url.to_owned()),
            probe,
            channel.clone(),
            wakers,
            options.check_ref(),
        )
        .await
        .map(Self)
        .map_err(|message| Error::Listen { channel, message })
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

/// `LISTEN "<channel>"`: the channel comes from a validated [`TableName`] (lowercase letters,
/// digits, `_` and `.`), and any `"` would be doubled.
fn listen_sql(channel: &str) -> String {
    format!("LISTEN \"{}\"", channel.replace('"', "\"\""))
}

struct DieselSource(String);

#[async_trait]
impl WakeSource for DieselSource {
    type Conn = AsyncPgConnection;

    async fn listen(&self, channel: &str) -> Result<AsyncPgConnection, String> {
        let mut conn = crate::tls::establish(&self.0)
            .await
            .map_err(|e| e.to_string())?;
        // The simple protocol: no statement is prepared (R194).
        conn.batch_execute(&listen_sql(channel))
            .await
            .map_err(|e| e.to_string())?;
        Ok(conn)
    }

    async fn until_lost(
        &self,
        conn: &mut AsyncPgConnection,
        note: &(dyn for<'p> Fn(&'p str) + Sync),
    ) -> Option<String> {
        let mut stream = std::pin::pin!(conn.notifications_stream());
        loop {
            match stream.next().await {
                Some(Ok(n)) => note(&n.payload),
                Some(Err(e)) => return Some(e.to_string()),
                None => return None,
            }
        }
    }
}
