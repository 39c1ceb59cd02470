//! The sqlx inbox: [`PgInbox`] over [`SqlxDriver`]; a handler gets a sqlx [`Transaction`]
//! (R181): write through `&mut **tx`.

use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use crate::driver::sqlx::SqlxDriver;
use crate::inbox::sql as isql;
use crate::inbox::store::PgInbox;
use crate::sql::{Layout, TableName};

/// The sqlx inbox.
pub type SqlxInbox = PgInbox<SqlxDriver>;

/// What a sqlx handler gets (R181).
pub type SqlxHandlerTx = Transaction<'static, Postgres>;

impl SqlxInbox {
    /// The sqlx inbox on `table` (plain or partitioned) over `pool`.
    pub fn sqlx(pool: PgPool, table: &TableName, layout: Layout) -> Self {
        PgInbox::new(SqlxDriver(pool), table, layout)
    }
}

/// Creates the inbox schema of `table` (Appendix D; idempotent, [`isql::inbox_ddl`]) in one
/// transaction under the schema-creation advisory lock.
pub async fn create_inbox_schema(
    pool: &PgPool,
    table: &TableName,
    layout: Layout,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1::text))")
        .bind(isql::schema_lock_key(table))
        .execute(&mut *tx)
        .await?;
    for stmt in isql::inbox_ddl(table, layout) {
        sqlx::raw_sql(AssertSqlSafe(stmt)).execute(&mut *tx).await?;
    }
    tx.commit().await
}
