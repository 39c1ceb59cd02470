//! Creating the schema with sqlx: [`create_schema`], [`create_schema_with`] and
//! [`ensure_partitions`]; what stands under a table's name: [`table_kind`].

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPool;

use crate::error::Error;
use crate::sql::{self, Layout, Statements, TableName};

/// Creates the table and its indexes if missing, in one transaction under an advisory lock
/// (idempotent; on an existing ancestor table it adds only what is missing, R79). Creates the
/// schema of a qualified name too. The plain layout; see [`create_schema_with`].
pub async fn create_schema(pool: &PgPool, table: &TableName) -> Result<(), Error> {
    create_schema_with(pool, table, Layout::Plain).await
}

/// [`create_schema`] for either layout. For [`Layout::Partitioned`] it runs
/// [`sql::partitioned::ddl`] with [`sql::partitioned::DEFAULT_MONTHS_AHEAD`]: the partitioned
/// table, its default partition, the seven indexes and the monthly partitions of this month
/// and the next three; it refuses (changing nothing) an existing table that is not
/// partitioned. Idempotent.
pub async fn create_schema_with(
    pool: &PgPool,
    table: &TableName,
    layout: Layout,
) -> Result<(), Error> {
    let ddl = match layout {
        Layout::Plain => sql::ddl(table),
        Layout::Partitioned => sql::partitioned::ddl(table, sql::partitioned::DEFAULT_MONTHS_AHEAD),
    };
    locked_ddl(pool, table, "schema creation", ddl).await
}

/// Partitioned layout: creates the missing monthly partitions from the current month (database
/// clock, UTC months) through `months_ahead` months ahead (at most
/// [`sql::partitioned::MONTHS_AHEAD_MAX`]), in one transaction under the schema advisory lock
/// ([`sql::partitioned::ensure_partitions`]). Run it regularly (daily, say) so each month's
/// partition exists before its rows arrive. Fails with [`Error::Database`], creating nothing,
/// when the default partition already holds rows of a missing month (the message says what to
/// do), and with [`Error::Partitions`] for a bad `months_ahead`.
pub async fn ensure_partitions(
    pool: &PgPool,
    table: &TableName,
    months_ahead: u32,
) -> Result<(), Error> {
    let n = sql::partitioned::check_months_ahead(months_ahead)?;
    let stmt = sql::partitioned::ensure_partitions(table, n);
    locked_ddl(pool, table, "partition maintenance", vec![stmt]).await
}

/// What stands under a table's name ([`table_kind`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableKind {
    /// Nothing has that name.
    Missing,
    /// An ordinary table (the plain layout).
    Plain,
    /// A partitioned table (the partitioned layout).
    Partitioned,
    /// Something else (a view, a sequence, …): its `pg_class.relkind`.
    Other(String),
}

/// What stands under `table`'s name (statement [`Statements::table_kind`], the name bound). The
/// error is sqlx's own, so that a caller can tell a server that is down (SQLSTATE class 08, 57P,
/// 53, or none) from one that refuses.
pub async fn table_kind(pool: &PgPool, table: &TableName) -> Result<TableKind, sqlx::Error> {
    // Unnamed and in a transaction, so that it also works through a transaction-pooling proxy
    // (R194): the binaries check the table with it in either pooler mode.
    let stmts = Statements::new(table);
    let mut tx = pool.begin().await?;
    let kind: Option<String> = sqlx::query_scalar(AssertSqlSafe(stmts.table_kind))
        .bind(table.dotted())
        .persistent(false)
        .fetch_optional(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(match kind.as_deref() {
        None => TableKind::Missing,
        Some("r") => TableKind::Plain,
        Some("p") => TableKind::Partitioned,
        Some(other) => TableKind::Other(other.to_owned()),
    })
}

async fn locked_ddl(
    pool: &PgPool,
    table: &TableName,
    during: &'static str,
    ddl: Vec<String>,
) -> Result<(), Error> {
    let db = |e: sqlx::Error| Error::Database {
        during,
        message: e.to_string(),
    };
    let stmts = Statements::new(table);
    let mut tx = pool.begin().await.map_err(db)?;
    sqlx::query(AssertSqlSafe(stmts.schema_lock.as_str()))
        .bind(stmts.schema_lock_key())
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    for s in ddl {
        sqlx::raw_sql(AssertSqlSafe(s))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
    }
    tx.commit().await.map_err(db)
}
