#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod driver;
pub mod error;
pub mod inbox;
pub mod outbox;
pub mod shared;
pub mod sql;
pub mod wake;

#[cfg(feature = "sqlx")]
pub mod listen;
#[cfg(feature = "sqlx")]
mod repository;
#[cfg(feature = "sqlx")]
mod schema;

pub use error::Error;
#[cfg(feature = "sqlx")]
pub use inbox::{SqlxHandlerTx, SqlxInbox, create_inbox_schema};
#[cfg(feature = "sqlx")]
pub use listen::WakeListener;
pub use outbox::PgConfig;
#[cfg(feature = "sqlx")]
pub use repository::{PgOutboxRepository, PgOutboxWriter};
#[cfg(feature = "sqlx")]
pub use schema::{TableKind, create_schema, create_schema_with, ensure_partitions, table_kind};
pub use sql::{Layout, Pooler, TableName};
/// The sqlx this crate is built with: name its types as `txoutbox_postgres::sqlx::…`, so your pool
/// and transactions are the ones the writer and the repository take, whatever sqlx you depend on.
#[cfg(feature = "sqlx")]
pub use sqlx;
