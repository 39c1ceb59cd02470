//! The sqlx driver's error mapping into the repository vocabulary.

use txoutbox_core::error::RepositoryError;

use crate::sql::{self, ErrorClass, TableName};

/// Maps a sqlx error to the core vocabulary: connection, pool and timeout problems are
/// [`RepositoryError::Unavailable`] (transient for the relay); constraint violations are
/// [`RepositoryError::Constraint`] naming the rule; a missing table is
/// [`RepositoryError::Schema`].
///
/// A database error is quoted by the server's message alone: sqlx's display of it appends the
/// server's source line (`at line 1371`), which tells a user nothing.
pub fn map_err(table: &TableName, e: sqlx::Error) -> RepositoryError {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let msg = db.message();
            match sql::classify(&code) {
                ErrorClass::Transient => RepositoryError::Unavailable {
                    message: format!("{msg} (SQLSTATE {code})"),
                },
                ErrorClass::Constraint => RepositoryError::Constraint {
                    message: match db.constraint() {
                        Some(c) => format!("{} ({msg})", sql::constraint_rule(table, c)),
                        None => format!("{msg} (SQLSTATE {code})"),
                    },
                },
                ErrorClass::Schema => RepositoryError::Schema(format!(
                    "{msg} (SQLSTATE {code}); {}",
                    sql::missing_table_hint(table, sql::TableRole::Outbox)
                )),
                ErrorClass::Other => RepositoryError::Other(format!("{msg} (SQLSTATE {code})")),
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
