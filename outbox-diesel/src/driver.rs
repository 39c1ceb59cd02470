//! The diesel-async driver of `txoutbox_postgres::driver` (semver-exempt): [`DieselDriver`] on
//! a deadpool pool, statements on [`Diesel`], a wrapper of an [`AsyncPgConnection`]. Every
//! statement is prepared once per connection (see `prepared.rs`).

use std::ops::{Deref, DerefMut};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::pg::Pg;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::result::QueryResult;
use diesel::sql_types::{Array, BigInt, Bool, Int4, Nullable, Text, Timestamptz};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};
use txoutbox_core::RepositoryError;
use txoutbox_core::repository::{BlockedKey, Fetched};
use txoutbox_postgres::driver::outbox::{AppliedRow, CountRow, OutboxDriver, OutboxRows};
use txoutbox_postgres::driver::{Bind, Connection, Driver};
use txoutbox_postgres::sql::pooler::is_unprepared;
use txoutbox_postgres::sql::{RawRow, TableName};
use uuid::Uuid;

use crate::error::{map_diesel, map_pool};
use crate::pool::{PgPool, PooledConnection};
use crate::prepared::Prepared;
use crate::row::{AgeRow, BlockedRow, FetchedRow, HeadRow, IsolationRow, NowRow, OutboxRow};

type SqlUuid = diesel::sql_types::Uuid;
type Boxed<'a> = BoxedSqlQuery<'a, Pg, SqlQuery>;

/// Binds `binds` to `q` in order, each with its SQL type.
fn bind_all(mut q: Boxed<'_>, binds: Vec<Bind>) -> Boxed<'_> {
    for b in binds {
        q = match b {
            Bind::Uuid(v) => q.bind::<SqlUuid, _>(v),
            Bind::Uuids(v) => q.bind::<Array<SqlUuid>, _>(v),
            Bind::OptUuids(v) => q.bind::<Nullable<Array<SqlUuid>>, _>(v),
            Bind::Text(v) => q.bind::<Text, _>(v),
            Bind::Texts(v) => q.bind::<Array<Text>, _>(v),
            Bind::OptTexts(v) => q.bind::<Nullable<Array<Text>>, _>(v),
            Bind::NullableTexts(v) => q.bind::<Array<Nullable<Text>>, _>(v),
            Bind::Int4(v) => q.bind::<Int4, _>(v),
            Bind::Int8(v) => q.bind::<BigInt, _>(v),
            Bind::Int4s(v) => q.bind::<Array<Int4>, _>(v),
            Bind::NullableInt8s(v) => q.bind::<Array<Nullable<BigInt>>, _>(v),
            Bind::Bools(v) => q.bind::<Array<Bool>, _>(v),
            Bind::Timestamp(v) => q.bind::<Timestamptz, _>(v),
            Bind::NullableTimestamps(v) => q.bind::<Array<Nullable<Timestamptz>>, _>(v),
        };
    }
    q
}

/// `sql` with `binds`, cached per connection unless it is marked for a transaction-pooling
/// proxy (R194, [`txoutbox_postgres::sql::pooler`]).
pub(crate) fn query(sql: &str, binds: Vec<Bind>) -> Prepared<Boxed<'_>> {
    Prepared(
        bind_all(diesel::sql_query(sql).into_boxed(), binds),
        !is_unprepared(sql),
    )
}

/// Before a statement: a statement marked for a transaction-pooling proxy (R194) on a
/// connection outside a transaction gets a transaction of its own, so that the Parse, Bind and
/// Close of its one execution reach the same server connection. Returns whether it began one
/// (then [`lone_end`] finishes it).
pub(crate) async fn lone_begin(conn: &mut AsyncPgConnection, sql: &str) -> QueryResult<bool> {
    if !is_unprepared(sql)
        || AnsiTransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth()?
            .is_some()
    {
        return Ok(false);
    }
    AnsiTransactionManager::begin_transaction(conn).await?;
    Ok(true)
}

/// After a statement: commits the transaction [`lone_begin`] began when the statement
/// succeeded, rolls it back otherwise.
pub(crate) async fn lone_end<T>(
    conn: &mut AsyncPgConnection,
    began: bool,
    r: QueryResult<T>,
) -> QueryResult<T> {
    if !began {
        return r;
    }
    match r {
        Ok(v) => {
            AnsiTransactionManager::commit_transaction(conn).await?;
            Ok(v)
        }
        Err(e) => {
            let _ = AnsiTransactionManager::rollback_transaction(conn).await;
            Err(e)
        }
    }
}

/// Runs `query(sql, binds).$method(conn)` between [`lone_begin`] and [`lone_end`]: the one
/// way every statement of this driver runs.
macro_rules! run {
    ($conn:expr, $sql:expr, $binds:expr, $method:ident) => {{
        let conn: &mut diesel_async::AsyncPgConnection = $conn;
        let sql: &str = $sql;
        let began = $crate::driver::lone_begin(conn, sql).await?;
        let r = $crate::driver::query(sql, $binds).$method(conn).await;
        $crate::driver::lone_end(conn, began, r).await
    }};
}
pub(crate) use run;

/// A diesel-async connection (`&mut AsyncPgConnection`, a pooled one, …) that runs the
/// statements of the driver layer.
pub struct Diesel<T>(pub T);

#[async_trait]
impl<T: DerefMut<Target = AsyncPgConnection> + Send> Connection for Diesel<T> {
    type Error = diesel::result::Error;

    fn map_err(table: &TableName, e: Self::Error) -> RepositoryError {
        map_diesel(table, e)
    }

    fn server_message(e: &Self::Error) -> Option<&str> {
        match e {
            diesel::result::Error::DatabaseError(_, info) => Some(info.message()),
            _ => None,
        }
    }

    fn in_transaction(&mut self) -> Result<bool, Self::Error> {
        Ok(
            AnsiTransactionManager::transaction_manager_status_mut(&mut *self.0)
                .transaction_depth()?
                .is_some(),
        )
    }

    async fn execute(&mut self, sql: &str, binds: Vec<Bind>) -> Result<u64, Self::Error> {
        Ok(run!(&mut *self.0, sql, binds, execute)? as u64)
    }
}

#[async_trait]
impl<T: DerefMut<Target = AsyncPgConnection> + Send> OutboxRows for Diesel<T> {
    async fn heads(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(Option<Uuid>, String, String)>, Self::Error> {
        let rows: Vec<HeadRow> = run!(&mut *self.0, sql, binds, load)?;
        Ok(rows
            .into_iter()
            .map(|h| (h.head_id, h.topic, h.partition_key))
            .collect())
    }

    async fn fetched(&mut self, sql: &str, binds: Vec<Bind>) -> Result<Vec<Fetched>, Self::Error> {
        let rows: Vec<FetchedRow> = run!(&mut *self.0, sql, binds, load)?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    async fn events(&mut self, sql: &str, binds: Vec<Bind>) -> Result<Vec<RawRow>, Self::Error> {
        let rows: Vec<OutboxRow> = run!(&mut *self.0, sql, binds, load)?;
        Ok(rows.into_iter().map(RawRow::from).collect())
    }

    async fn applied(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<AppliedRow>, Self::Error> {
        let rows: Vec<crate::row::AppliedRow> = run!(&mut *self.0, sql, binds, load)?;
        Ok(rows
            .into_iter()
            .map(|r| AppliedRow {
                id: r.id,
                status: r.status,
                attempts_made: r.attempts_made,
                scheduled_at: r.scheduled_at,
            })
            .collect())
    }

    async fn blocked(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<BlockedKey>, Self::Error> {
        let rows: Vec<BlockedRow> = run!(&mut *self.0, sql, binds, load)?;
        Ok(rows.into_iter().map(BlockedKey::from).collect())
    }

    async fn counts(&mut self, sql: &str) -> Result<Vec<CountRow>, Self::Error> {
        let rows: Vec<crate::row::CountRow> = run!(&mut *self.0, sql, Vec::new(), load)?;
        Ok(rows.into_iter().map(CountRow::from).collect())
    }

    async fn now(&mut self, sql: &str) -> Result<DateTime<Utc>, Self::Error> {
        // The shared text is `SELECT now()`, whose column PostgreSQL names `now`.
        let r: NowRow = run!(&mut *self.0, sql, Vec::new(), get_result)?;
        Ok(r.now)
    }

    async fn isolation(&mut self, sql: &str, binds: Vec<Bind>) -> Result<String, Self::Error> {
        let r: IsolationRow = run!(&mut *self.0, sql, binds, get_result)?;
        Ok(r.isolation)
    }

    async fn age_us(&mut self, sql: &str) -> Result<Option<i64>, Self::Error> {
        let r: AgeRow = run!(&mut *self.0, sql, Vec::new(), get_result)?;
        Ok(r.age_us)
    }
}

/// The diesel-async driver: a deadpool pool of [`AsyncPgConnection`]s.
#[derive(Clone)]
pub struct DieselDriver(pub PgPool);

impl std::fmt::Debug for DieselDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DieselDriver")
            .field(&self.0.status())
            .finish()
    }
}

impl From<PgPool> for DieselDriver {
    fn from(pool: PgPool) -> Self {
        Self(pool)
    }
}

impl DieselDriver {
    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.0
    }
}

/// A pooled connection in autocommit.
pub type PooledDiesel = Box<Diesel<PooledConnection>>;

/// An open transaction on a pooled connection. Dropping it unfinished detaches its connection
/// from the pool and closes it, which rolls the transaction back: a connection with an open
/// transaction never goes back to the pool.
pub struct DieselTx(Option<Diesel<PooledConnection>>);

impl Deref for DieselTx {
    type Target = Diesel<PooledConnection>;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("an open transaction")
    }
}

impl DerefMut for DieselTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0.as_mut().expect("an open transaction")
    }
}

impl Drop for DieselTx {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(deadpool::managed::Object::take(conn.0));
        }
    }
}

#[async_trait]
impl Driver for DieselDriver {
    type Conn = Diesel<PooledConnection>;
    type Pooled = PooledDiesel;
    type Tx = DieselTx;

    const NAME: &'static str = "postgres-diesel";
    const NOT_IN_TRANSACTION: &'static str = "the outbox write needs the caller's open transaction: call it inside conn.transaction(async |conn| …)";

    async fn acquire(&self, _table: &TableName) -> Result<Self::Pooled, RepositoryError> {
        Ok(Box::new(Diesel(self.0.get().await.map_err(map_pool)?)))
    }

    async fn begin(&self, table: &TableName) -> Result<Self::Tx, RepositoryError> {
        let mut conn = self.0.get().await.map_err(map_pool)?;
        AnsiTransactionManager::begin_transaction(&mut *conn)
            .await
            .map_err(|e| map_diesel(table, e))?;
        Ok(DieselTx(Some(Diesel(conn))))
    }

    async fn begin_on(table: &TableName, conn: Self::Pooled) -> Result<Self::Tx, RepositoryError> {
        let Diesel(mut conn) = *conn;
        AnsiTransactionManager::begin_transaction(&mut *conn)
            .await
            .map_err(|e| map_diesel(table, e))?;
        Ok(DieselTx(Some(Diesel(conn))))
    }

    async fn commit(table: &TableName, mut tx: Self::Tx) -> Result<(), RepositoryError> {
        AnsiTransactionManager::commit_transaction(&mut *(*tx).0)
            .await
            .map_err(|e| map_diesel(table, e))?;
        // Committed: the connection goes back to the pool.
        drop(tx.0.take());
        Ok(())
    }

    async fn rollback(table: &TableName, mut tx: Self::Tx) -> Result<(), RepositoryError> {
        AnsiTransactionManager::rollback_transaction(&mut *(*tx).0)
            .await
            .map_err(|e| map_diesel(table, e))?;
        drop(tx.0.take());
        Ok(())
    }
}

impl OutboxDriver for DieselDriver {
    type Writer = crate::DieselOutboxWriter;
}
