//! Errors: this crate's own [`Error`] and the mapping of diesel, diesel-async and pool errors
//! into outbox-core's [`RepositoryError`].
//!
//! | source | becomes |
//! |---|---|
//! | connection could not be set up, closed or broken; pool wait timed out or pool closed | [`RepositoryError::Unavailable`] (transient: the relay spends no attempt) |
//! | serialization failure, deadlock, server shutting down, too many connections | [`RepositoryError::Unavailable`] |
//! | unique, check, not-null or foreign-key violation | [`RepositoryError::Constraint`], naming the constraint and the rule it enforces |
//! | missing table or column | [`RepositoryError::Schema`] (run the migrations) |
//! | anything else | [`RepositoryError::Other`] |

use diesel::result::{ConnectionError, DatabaseErrorKind, Error as DieselError};
use diesel_async::pooled_connection::PoolError as ManagerError;
use diesel_async::pooled_connection::deadpool::PoolError;
use txoutbox_core::RepositoryError;
use txoutbox_postgres::sql::{self, TableName};

/// A failure of this crate outside the repository trait: configuration, pool, migrations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is invalid (the message names it and the allowed range).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The table name is not a safe identifier (R78).
    #[error(transparent)]
    TableName(#[from] txoutbox_postgres::Error),
    /// The connection pool could not be built.
    #[error("could not build the connection pool: {0}; check the database URL and pool size")]
    Pool(String),
    /// Creating the schema failed.
    #[error(
        "creating the outbox schema for {table} failed: {message}; check that the database user may create schemas, tables and indexes"
    )]
    Migration {
        /// The table.
        table: String,
        /// What failed.
        message: String,
    },
    /// Partition maintenance of a partitioned table failed (`ensure_partitions`); the message
    /// says why and what to do.
    #[error("partition maintenance of the outbox table {table} failed: {message}")]
    Partitions {
        /// The table.
        table: String,
        /// What failed.
        message: String,
    },
    /// The wake-up listener could not connect or LISTEN.
    #[error(
        "LISTEN on {channel} failed: {message}; check the database URL and that PostgreSQL runs (the relays still poll without it)"
    )]
    Listen {
        /// The notification channel.
        channel: String,
        /// What failed.
        message: String,
    },
    /// A backend operation failed.
    #[error(transparent)]
    Repository(#[from] RepositoryError),
}

impl From<txoutbox_core::ConfigError> for Error {
    fn from(e: txoutbox_core::ConfigError) -> Self {
        Error::Config(e.to_string())
    }
}

/// Maps a diesel query error on `table` into the repository vocabulary.
///
/// This differs from the sqlx backend's `txoutbox_postgres::map_err`, which classifies by SQLSTATE
/// with `txoutbox_postgres::sql::classify`: diesel-async keeps the SQLSTATE only as a
/// [`DatabaseErrorKind`] for the integrity and serialization classes, and reports every other
/// code as `Unknown` with the server's message alone. So the kinds are mapped here, and the
/// `Unknown` rest is told apart by the server's wording (`classify_unknown`).
pub fn map_diesel(table: &TableName, e: DieselError) -> RepositoryError {
    match e {
        DieselError::DatabaseError(kind, info) => {
            let message = info.message().to_owned();
            match kind {
                DatabaseErrorKind::UniqueViolation
                | DatabaseErrorKind::CheckViolation
                | DatabaseErrorKind::NotNullViolation
                | DatabaseErrorKind::ForeignKeyViolation
                | DatabaseErrorKind::RestrictViolation
                | DatabaseErrorKind::ExclusionViolation => {
                    let rule = match (info.constraint_name(), info.column_name()) {
                        (Some(c), _) => sql::constraint_rule(table, c),
                        (None, Some(col)) => format!("{col}: must not be null"),
                        (None, None) => "an integrity rule of the table".to_owned(),
                    };
                    RepositoryError::Constraint {
                        message: format!("{rule} ({message})"),
                    }
                }
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand => {
                    RepositoryError::Unavailable { message }
                }
                DatabaseErrorKind::SerializationFailure => RepositoryError::Unavailable {
                    message: format!("{message} (serialization failure; retry the operation)"),
                },
                _ => classify_unknown(table, message),
            }
        }
        DieselError::BrokenTransactionManager => RepositoryError::Unavailable {
            message: "the connection's transaction state is broken; the pool replaces it".into(),
        },
        DieselError::DeserializationError(e) => {
            RepositoryError::Other(format!("could not decode a result: {e}"))
        }
        other => RepositoryError::Other(other.to_string()),
    }
}

/// The `Unknown` database errors, by the server's (English) wording.
fn classify_unknown(table: &TableName, message: String) -> RepositoryError {
    let lower = message.to_ascii_lowercase();
    if lower.contains("does not exist")
        && (lower.contains("relation") || lower.contains("column") || lower.contains("schema"))
    {
        RepositoryError::Schema(format!(
            "{message}; {}",
            sql::missing_table_hint(table, sql::TableRole::Outbox)
        ))
    } else if lower.contains("deadlock detected")
        || lower.contains("terminating connection")
        || lower.contains("canceling statement due to")
        || lower.contains("the database system is")
        || lower.contains("too many connections")
        || lower.contains("could not obtain lock")
    {
        RepositoryError::Unavailable { message }
    } else {
        RepositoryError::Other(message)
    }
}

/// Maps a failure to connect: transient.
pub fn map_connection(e: ConnectionError) -> RepositoryError {
    RepositoryError::Unavailable {
        message: format!("could not connect to PostgreSQL: {e}"),
    }
}

/// Maps a deadpool error (wait timeout, closed pool, connect or health-check failure): always
/// transient.
pub fn map_pool(e: PoolError) -> RepositoryError {
    use diesel_async::pooled_connection::deadpool::PoolError as P;
    let message = match e {
        P::Backend(ManagerError::ConnectionError(c)) => return map_connection(c),
        P::Backend(ManagerError::QueryError(q)) => {
            format!("a pooled connection failed its health check: {q}")
        }
        P::Timeout(t) => format!(
            "timed out waiting for a pooled connection ({t:?}); raise the pool size or its wait timeout"
        ),
        P::Closed => "the connection pool is closed".to_owned(),
        P::NoRuntimeSpecified => "the pool has no runtime for its timeouts".to_owned(),
        P::PostCreateHook(h) => format!("the pool's post-create hook failed: {h}"),
    };
    RepositoryError::Unavailable { message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_errors_are_classified() {
        let t = TableName::default();
        assert!(matches!(
            classify_unknown(&t, "relation \"x.outbox_events\" does not exist".into()),
            RepositoryError::Schema(_)
        ));
        assert!(classify_unknown(&t, "deadlock detected".into()).is_transient());
        assert!(matches!(
            classify_unknown(&t, "syntax error at or near \"x\"".into()),
            RepositoryError::Other(_)
        ));
    }

    #[test]
    fn closed_connections_are_transient() {
        let e = DieselError::DatabaseError(
            DatabaseErrorKind::ClosedConnection,
            Box::new("connection closed".to_owned()),
        );
        assert!(map_diesel(&TableName::default(), e).is_transient());
    }

    #[test]
    fn pool_timeouts_are_transient() {
        let e = PoolError::Timeout(deadpool::managed::TimeoutType::Wait);
        assert!(map_pool(e).is_transient());
        assert!(map_pool(PoolError::Closed).is_transient());
    }
}
