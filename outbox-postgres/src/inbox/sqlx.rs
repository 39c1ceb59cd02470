//! The sqlx inbox: [`PgInbox`] over [`SqlxDriver`]; a handler gets a sqlx [`Transaction`]
//! (R181): write through `&mut **tx`.

use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};
use txoutbox_core::error::RepositoryError;

use crate::driver::sqlx::SqlxDriver;
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

/// Creates the inbox schema of `table` (Appendix D; idempotent, R173's index rule: see
/// [`crate::inbox::schema`]) in one transaction under the schema-creation advisory lock.
pub async fn create_inbox_schema(
    pool: &PgPool,
    table: &TableName,
    layout: Layout,
) -> Result<(), RepositoryError> {
    crate::inbox::schema::create_inbox_schema_with(&SqlxDriver(pool.clone()), table, layout).await
}
