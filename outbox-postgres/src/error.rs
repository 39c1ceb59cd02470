//! The error enum of `outbox-postgres`.

use thiserror::Error;

/// A configuration or schema problem of this crate. Repository operations report
/// [`txoutbox_core::RepositoryError`] instead; see [`crate::sql::classify`] for how database errors
/// map onto it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Error {
    /// The configured table name is not a safe identifier (R78).
    #[error(
        "invalid outbox table name {name:?}: {reason}; use `table` or `schema.table` where each part matches ^[a-z_][a-z0-9_]*$ (table at most 31 characters, schema at most 63)"
    )]
    TableName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A partition setting of the partitioned layout is out of range.
    #[error("invalid partition setting: {0}")]
    Partitions(String),
    /// A setting is out of range (the wake-up check's intervals, R196; the pooler mode, R194).
    #[error("invalid setting: {0}")]
    Config(String),
    /// A database operation outside the repository trait failed (schema creation, connect).
    #[error("database error during {during}: {message}")]
    Database {
        /// What was being done.
        during: &'static str,
        /// What the driver said.
        message: String,
    },
}
