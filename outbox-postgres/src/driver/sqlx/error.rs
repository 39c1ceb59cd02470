//! The sqlx driver's error mapping into the repository vocabulary.

use txoutbox_core::error::RepositoryError;

use crate::sql::{self, ErrorClass, TableName};

/// Maps a sqlx error to the core vocabulary: connection, pool and timeout problems are
/// [`RepositoryError::Unavailable`] (transient for the relay); constraint violations are
/// [`RepositoryError::Constraint`] naming the rule; a missing table is
/// [`RepositoryError::Schema`].
pub fn map_err(table: &TableName, e: sqlx::Error) -> RepositoryError {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match sql::classify(&code) {
                ErrorClass::Transient => RepositoryError::Unavailable {
                    message: format!("{db} (SQLSTATE {code})"),
                },
                ErrorClass::Constraint => RepositoryError::Constraint {
                    message: match db.constraint() {
                        Some(c) => format!("{} ({db})", sql::constraint_rule(table, c)),
                        None => format!("{db} (SQLSTATE {code})"),
                    },
                },
                ErrorClass::Schema => RepositoryError::Schema(format!(
                    "{db} (SQLSTATE {code}); create the schema for table {table} first (create_schema)"
                )),
                ErrorClass::Other => RepositoryError::Other(format!("{db} (SQLSTATE {code})")),
            }
        }
        e @ (sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_)) => RepositoryError::Unavailable {
            message: e.to_string(),
        },
        other => RepositoryError::Other(other.to_string()),
    }
}
