//! The driver layer: what a PostgreSQL driver (sqlx, diesel-async, …) provides so that the
//! stores' flows — the outbox's writer, fetch and outcome writes, and the inbox's — are written
//! once, in this crate, over it.
//!
//! **This module serves backend implementers, not users, and is exempt from semver**: its
//! traits and types may change in any release. Users name the repositories and writers at the
//! crate roots (`txoutbox_postgres::PgOutboxRepository`, `txoutbox_diesel::DieselOutboxRepository`).
//!
//! # The pieces
//!
//! - [`Bind`]: one typed parameter value. A flow builds the binds of a statement in `$n` order;
//!   the driver binds each with its own SQL type (`uuid`, `text[]`, `timestamptz[]`, …).
//! - [`Connection`]: one connection, inside a transaction or not. Its methods run one statement
//!   each: [`Connection::execute`] returns the rows affected; the row-shape methods return
//!   decoded rows (the outbox's in [`outbox::OutboxRows`], the inbox's beside it). A driver
//!   keeps its own error type ([`Connection::Error`]) and maps it, once, with
//!   [`Connection::map_err`].
//! - [`Driver`]: the pool side: a connection in autocommit ([`Driver::acquire`]) and a
//!   transaction handle ([`Driver::begin`], or [`Driver::begin_on`] a connection already
//!   acquired; [`Driver::commit`], [`Driver::rollback`]).
//!
//! # How a store uses it
//!
//! A store's flow is generic over `D: Driver` whose connection implements the store's row
//! shapes, and runs statements of [`crate::sql::Statements`] (or its own statement set):
//!
//! ```ignore
//! async fn requeue<D: Driver>(d: &D, stmts: &Statements, id: Uuid) -> Result<bool, RepositoryError>
//! where
//!     D::Conn: OutboxRows,
//! {
//!     let mut c = d.acquire(&stmts.table).await?;
//!     let n = c
//!         .execute(&stmts.requeue, vec![Bind::Uuid(id)])
//!         .await
//!         .map_err(|e| D::Conn::map_err(&stmts.table, e))?;
//!     Ok(n == 1)
//! }
//! ```
//!
//! In a transaction: `let mut tx = d.begin(table).await?;` run statements on `&mut *tx`, then
//! [`Driver::commit`] it, or [`Driver::rollback`] it on an error (dropping an unfinished
//! transaction rolls it back too, but a driver may then close its connection).
//!
//! The sqlx driver is `driver::sqlx` (cargo feature `sqlx`); the diesel-async driver lives in
//! outbox-diesel, which compiles no sqlx.

pub mod inbox;
pub mod outbox;
#[cfg(feature = "sqlx")]
pub mod sqlx;

use std::ops::DerefMut;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::error::RepositoryError;
use uuid::Uuid;

use crate::sql::TableName;

/// One typed parameter value of a statement (`$n`), named after its PostgreSQL type.
/// Exhaustive on purpose: a variant added here is a compile error in every driver until it binds it.
#[derive(Debug, Clone, PartialEq)]
pub enum Bind {
    /// `uuid`.
    Uuid(Uuid),
    /// `uuid[]`.
    Uuids(Vec<Uuid>),
    /// `uuid[]` or NULL.
    OptUuids(Option<Vec<Uuid>>),
    /// `text`.
    Text(String),
    /// `text[]`.
    Texts(Vec<String>),
    /// `text[]` or NULL.
    OptTexts(Option<Vec<String>>),
    /// `text[]` whose elements may be NULL.
    NullableTexts(Vec<Option<String>>),
    /// `int4`.
    Int4(i32),
    /// `int8`.
    Int8(i64),
    /// `int4[]`.
    Int4s(Vec<i32>),
    /// `int8[]` whose elements may be NULL.
    NullableInt8s(Vec<Option<i64>>),
    /// `bool[]`.
    Bools(Vec<bool>),
    /// `timestamptz`.
    Timestamp(DateTime<Utc>),
    /// `timestamptz[]` whose elements may be NULL.
    NullableTimestamps(Vec<Option<DateTime<Utc>>>),
}

/// One connection of a driver, inside a transaction or in autocommit. Each method runs one
/// statement (its text fixed, built from a validated table name; every value a [`Bind`]).
#[async_trait]
pub trait Connection: Send {
    /// The driver's own error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Maps the driver's error on `table` into the repository vocabulary: connection, pool and
    /// timeout problems are [`RepositoryError::Unavailable`], constraint violations
    /// [`RepositoryError::Constraint`] naming the rule, a missing table
    /// [`RepositoryError::Schema`].
    fn map_err(table: &TableName, e: Self::Error) -> RepositoryError;

    /// The server's message of a database error (`None` for any other error), for the flows
    /// that recognise a refusal by its text (`crate::sql::schedule_refusal`).
    fn server_message(e: &Self::Error) -> Option<&str>;

    /// Whether the connection is inside a transaction the driver knows of.
    fn in_transaction(&mut self) -> Result<bool, Self::Error>;

    /// Runs a statement; returns the number of rows it affected.
    async fn execute(&mut self, sql: &str, binds: Vec<Bind>) -> Result<u64, Self::Error>;
}

/// The pool side of a driver: connections and the transaction handle.
#[async_trait]
pub trait Driver: Clone + Send + Sync + 'static {
    /// The connection the statements run on.
    type Conn: Connection;
    /// A pooled connection in autocommit.
    type Pooled: DerefMut<Target = Self::Conn> + Send;
    /// An open transaction; dropping it unfinished rolls it back.
    type Tx: DerefMut<Target = Self::Conn> + Send + 'static;

    /// What the store reports as its name (`Capabilities::name`).
    const NAME: &'static str;
    /// What a write outside a transaction is told (R12): how to open one with this driver.
    const NOT_IN_TRANSACTION: &'static str;

    /// A connection in autocommit; errors are mapped for `table`.
    async fn acquire(&self, table: &TableName) -> Result<Self::Pooled, RepositoryError>;
    /// Begins a transaction on a pooled connection.
    async fn begin(&self, table: &TableName) -> Result<Self::Tx, RepositoryError>;
    /// Begins a transaction on `conn`, a connection acquired with [`Driver::acquire`] (the
    /// transaction delivery's fetch runs its heads statement on it in autocommit first).
    async fn begin_on(table: &TableName, conn: Self::Pooled) -> Result<Self::Tx, RepositoryError>;
    /// Commits `tx` and hands its connection back.
    async fn commit(table: &TableName, tx: Self::Tx) -> Result<(), RepositoryError>;
    /// Rolls `tx` back and hands its connection back (or closes it if the rollback fails).
    async fn rollback(table: &TableName, tx: Self::Tx) -> Result<(), RepositoryError>;
}

/// Commits `tx` when `result` is Ok, rolls it back otherwise (the rollback's own failure is
/// dropped: the result's error is the one to report).
pub async fn finish<D: Driver, T: Send>(
    table: &TableName,
    tx: D::Tx,
    result: Result<T, RepositoryError>,
) -> Result<T, RepositoryError> {
    match result {
        Ok(v) => {
            D::commit(table, tx).await?;
            Ok(v)
        }
        Err(e) => {
            let _ = D::rollback(table, tx).await;
            Err(e)
        }
    }
}
