//! The outbox's row shapes (semver-exempt, see [`crate::driver`]): each method runs one
//! statement of [`crate::sql::Statements`] and decodes its rows.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::repository::{BlockedKey, Fetched};
use uuid::Uuid;

use super::{Bind, Connection};
use crate::sql::RawRow;

/// One row of an outcome statement (`complete`, `fail`, `release` and their delivery forms):
/// `id, status, attempts_made, scheduled_at`.
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedRow {
    /// The row.
    pub id: Uuid,
    /// Its status after the write, as stored.
    pub status: String,
    /// Its attempts after the write.
    pub attempts_made: i32,
    /// Its next try after the write.
    pub scheduled_at: DateTime<Utc>,
}

/// One row of the counts statement: `topic, status, count`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountRow {
    /// The topic.
    pub topic: String,
    /// The status as stored.
    pub status: String,
    /// Rows of the topic in the status.
    pub count: i64,
}

/// The outbox statements' row shapes on a [`Connection`].
#[async_trait]
pub trait OutboxRows: Connection {
    /// `fetch_heads`: `(head_id, topic, partition_key)` per walked key.
    async fn heads(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(Option<Uuid>, String, String)>, Self::Error>;

    /// A take (`fetch_take`, `fetch_take_transaction`): the rows of `sql::COLUMNS`, each
    /// decoded or [`Fetched::Undecodable`] alone (R82); only an unreadable id fails.
    async fn fetched(&mut self, sql: &str, binds: Vec<Bind>) -> Result<Vec<Fetched>, Self::Error>;

    /// Rows of `sql::COLUMNS` (`insert`, `select_existing`, `get`), read column by column.
    async fn events(&mut self, sql: &str, binds: Vec<Bind>) -> Result<Vec<RawRow>, Self::Error>;

    /// An outcome statement's rows.
    async fn applied(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<AppliedRow>, Self::Error>;

    /// `blocked_keys`.
    async fn blocked(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<BlockedKey>, Self::Error>;

    /// `counts`.
    async fn counts(&mut self, sql: &str) -> Result<Vec<CountRow>, Self::Error>;

    /// `now`: the database's clock.
    async fn now(&mut self, sql: &str) -> Result<DateTime<Utc>, Self::Error>;

    /// `idempotency_lock`: the transaction's isolation level.
    async fn isolation(&mut self, sql: &str, binds: Vec<Bind>) -> Result<String, Self::Error>;

    /// `oldest_due_age`: microseconds, or NULL.
    async fn age_us(&mut self, sql: &str) -> Result<Option<i64>, Self::Error>;
}

/// The binds of [`crate::sql::Statements::fetch_heads`] in their order (`$1`–`$9`): `p`, then
/// the walk cursor's `(topic, partition_key)`. The one place that knows that order.
pub fn fetch_heads_binds(p: &crate::sql::FetchParams, cursor: (String, String)) -> Vec<Bind> {
    vec![
        Bind::Int8(p.limit),
        Bind::Int8(p.lease_us),
        Bind::OptTexts(p.topics.clone()),
        Bind::OptTexts(p.aggregate_types.clone()),
        Bind::OptUuids(p.aggregate_ids.clone()),
        Bind::Int8(p.window),
        Bind::Int8(p.walk_limit),
        Bind::Text(cursor.0),
        Bind::Text(cursor.1),
    ]
}

/// The binds of [`crate::sql::Statements::fetch_take`] and
/// [`crate::sql::Statements::fetch_take_transaction`] in their order (`$1`–`$8`): the worker,
/// `p`, and the candidate heads from the heads statement.
pub fn fetch_take_binds(worker: &str, p: &crate::sql::FetchParams, heads: Vec<Uuid>) -> Vec<Bind> {
    vec![
        Bind::Text(worker.to_owned()),
        Bind::Int8(p.limit),
        Bind::Int8(p.lease_us),
        Bind::Int8(p.max_per_key),
        Bind::OptTexts(p.topics.clone()),
        Bind::OptTexts(p.aggregate_types.clone()),
        Bind::OptUuids(p.aggregate_ids.clone()),
        Bind::Uuids(heads),
    ]
}

/// A driver whose connections run the outbox statements, and the writer its users hold: the
/// store's [`crate::outbox::Writer`] itself, or a type of the driver's crate around it that
/// takes the driver's own connection type.
pub trait OutboxDriver: super::Driver<Conn: OutboxRows> {
    /// The writer handed out by `Repository::writer`.
    type Writer: From<crate::outbox::Writer<Self>>;
}
