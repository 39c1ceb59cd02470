//! The binary's error type: every failure carries the exit code it ends the process with.

use txoutbox_core::RepositoryError;

/// Exit codes (also in `--help` and the README).
pub mod code {
    /// The command ran but what it was asked to change is not there or not in the needed state
    /// (unknown id, row not failed, row not locked, nothing matched). Nothing changed.
    pub const REFUSED: i32 = 1;
    /// Usage or configuration error: a bad flag value, an invalid table name or URL, a store not
    /// compiled in. Nothing changed.
    pub const USAGE: i32 = 2;
    /// The outbox or inbox table does not exist, the login was refused, the database is
    /// unknown, or (operator commands) the database cannot be reached.
    pub const DATABASE: i32 = 3;
    /// The broker is not compiled into this binary, or refused the stream set-up (`run` waits
    /// for an unreachable broker).
    pub const BROKER: i32 = 4;
    /// Any other failure.
    pub const OTHER: i32 = 5;
}

/// The text appended to `--help`.
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success (for `run`: stopped by SIGINT/SIGTERM, by --until-drained, or the loops ended)
  1  refused: unknown id, row not in the needed state, nothing matched; nothing changed
  2  usage or configuration error (bad flag value, invalid table name or URL, store not compiled in)
  3  the outbox table is missing (run `outbox-relay migrate`), the inbox table is missing (the
     consumer creates it: `create_inbox_schema`), a refused login or an unknown database; for
     the operator commands also an unreachable database (`run` waits for it)
  4  broker not compiled into this binary (enable its cargo feature) or its stream set-up
     refused; for `run` an unreachable broker is waited for, not an exit
  5  any other failure";

/// A failure of a command.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct CliError {
    /// The exit code.
    pub code: i32,
    /// What went wrong and what to do.
    pub message: String,
    /// Whether trying again later can help (a server that cannot be reached yet): `run` waits
    /// and retries these at start-up instead of exiting.
    pub retryable: bool,
}

impl CliError {
    /// A failure; passwords of any URL the message quotes (the driver's text included) are
    /// replaced by `***` here, so no error message of the binary carries one.
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: txoutbox_core::redact::secrets(&message.into()),
            retryable: false,
        }
    }

    /// The same error, marked as one that trying again later can fix.
    pub fn retryable(mut self) -> Self {
        self.retryable = true;
        self
    }

    pub fn usage(message: impl Into<String>) -> Self {
        Self::new(code::USAGE, message)
    }

    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(code::REFUSED, message)
    }

    /// A repository error of the outbox table, with the table it concerns for the advice.
    pub fn repo(table: &str, e: RepositoryError) -> Self {
        Self::repo_of(TableRole::Outbox, table, e)
    }

    /// A repository error of an outbox or inbox table, with the advice for that kind of table.
    pub fn repo_of(role: TableRole, table: &str, e: RepositoryError) -> Self {
        match e {
            RepositoryError::Validation(v) => Self::usage(v.to_string()),
            RepositoryError::Unavailable { message } => Self::new(
                code::DATABASE,
                format!(
                    "the database cannot be reached: {message}; check that PostgreSQL runs and --database-url (DATABASE_URL)"
                ),
            ),
            RepositoryError::Schema(m) => Self::new(
                code::DATABASE,
                format!("{m}; {}", role.create_advice(table)),
            ),
            RepositoryError::NotParked { message, .. } => Self::refused(message),
            RepositoryError::NotLocked(id) => Self::refused(format!(
                "{} {id} is not locked (or does not exist in {table}): nothing to force-unlock; nothing changed",
                role.row()
            )),
            other => Self::new(code::OTHER, other.to_string()),
        }
    }
}

/// Which kind of table a command works on: it decides the advice when the table is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableRole {
    /// An outbox table (`outbox-relay migrate` creates it).
    Outbox,
    /// An inbox table (the consumer creates it with `create_inbox_schema`).
    Inbox,
}

impl TableRole {
    /// `outbox` or `inbox`.
    pub fn name(self) -> &'static str {
        match self {
            TableRole::Outbox => "outbox",
            TableRole::Inbox => "inbox",
        }
    }

    /// What a row of this table is called in messages.
    pub fn row(self) -> &'static str {
        match self {
            TableRole::Outbox => "event",
            TableRole::Inbox => "inbox row",
        }
    }

    /// How to create the table `table`.
    pub fn create_advice(self, table: &str) -> String {
        match self {
            TableRole::Outbox => format!("run `outbox-relay migrate --table {table}`"),
            TableRole::Inbox => format!(
                "create it as the consumer does at start-up, with `create_inbox_schema` (txoutbox_postgres or txoutbox_diesel) for {table}, or check --table (INBOX_TABLE)"
            ),
        }
    }
}

pub type Result<T, E = CliError> = std::result::Result<T, E>;
