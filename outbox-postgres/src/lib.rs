#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod driver;
pub mod error;
pub mod inbox;
pub mod shared;
pub mod sql;

#[cfg(feature = "sqlx")]
mod backend;
#[cfg(feature = "sqlx")]
pub mod listen;
#[cfg(feature = "testing")]
pub mod testing;

#[cfg(feature = "sqlx")]
pub use backend::{
    PgConfig, PgOutboxRepository, PgOutboxWriter, bind_fetch_heads, bind_fetch_take, create_schema,
    create_schema_with, ensure_partitions, fetch_rows, fetched_row, map_err, raw_row,
};
pub use error::Error;
#[cfg(feature = "sqlx")]
pub use listen::WakeListener;
pub use sql::{Layout, TableName};
/// The sqlx this crate is built with: name its types as `outbox_postgres::sqlx::…`, so your pool
/// and transactions are the ones the writer and the repository take, whatever sqlx you depend on.
#[cfg(feature = "sqlx")]
pub use sqlx;
