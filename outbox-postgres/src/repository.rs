//! The sqlx backend's names for the store: [`PgOutboxRepository`] (relay and operator side)
//! and [`PgOutboxWriter`] (writes in the caller's transaction), over
//! [`crate::driver::sqlx::SqlxDriver`].

use sqlx::postgres::PgPool;

use crate::driver::sqlx::SqlxDriver;
use crate::error::Error;
use crate::outbox::{Repository, Writer};

/// The sqlx repository (relay and operator side) on a pool: `PgOutboxRepository::new(pool,
/// PgConfig::default())`. Create the schema first ([`crate::create_schema`]).
pub type PgOutboxRepository = Repository<SqlxDriver>;

/// Writes events inside the caller's transaction (R12): pass `&mut *tx` of a sqlx
/// `Transaction<'_, Postgres>` (or any `&mut PgConnection` inside a transaction). Never begins,
/// commits or rolls back. See [`Writer`].
pub type PgOutboxWriter = Writer<SqlxDriver>;

impl Repository<SqlxDriver> {
    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.driver.0
    }

    /// Partitioned layout: [`crate::ensure_partitions`] on this repository's pool and table.
    pub async fn ensure_partitions(&self, months_ahead: u32) -> Result<(), Error> {
        crate::schema::ensure_partitions(self.pool(), &self.cfg.table, months_ahead).await
    }
}
