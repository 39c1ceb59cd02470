#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod driver;
pub mod error;
pub mod inbox;
pub mod listen;
pub mod migrations;
pub mod pool;
mod prepared;
mod repository;
mod row;
pub mod schema;
pub mod tls;
mod writer;

pub use error::Error;
pub use inbox::{DieselInbox, create_inbox_schema, diesel_inbox};
pub use listen::WakeListener;
pub use migrations::{
    OutboxMigrations, create_schema, create_schema_with, ensure_partitions, run_migrations,
    run_migrations_url, run_migrations_with,
};
pub use pool::{MAX_POOL_SIZE, PgPool, PoolSettings, PooledConnection, build_pool};
pub use repository::{DieselConfig, DieselOutboxRepository};
pub use txoutbox_postgres::sql::{Layout, TableName};
pub use writer::{DieselOutboxWriter, WriteError};
/// The diesel and diesel-async this crate is built with: name their types through these, so
/// your connections and transactions are the ones the writer takes.
pub use {diesel, diesel_async};
