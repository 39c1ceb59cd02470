//! Error classification by SQLSTATE, driver-independent.

use super::*;

// ---------------------------------------------------------------------------------------------
// Error classification
// ---------------------------------------------------------------------------------------------

/// What a failed statement means for the caller, from its SQLSTATE (driver-independent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Connection lost, server shutting down, too many connections, serialization failure or
    /// deadlock, statement timeout: retry later (`RepositoryError::Unavailable`).
    Transient,
    /// An integrity constraint (class 23): `RepositoryError::Constraint` naming the rule.
    Constraint,
    /// The table or a column is missing: run the schema creation (`RepositoryError::Schema`).
    Schema,
    /// Anything else (`RepositoryError::Other`).
    Other,
}

/// Classifies a SQLSTATE code.
pub fn classify(sqlstate: &str) -> ErrorClass {
    match sqlstate {
        s if s.starts_with("08") => ErrorClass::Transient, // connection exception
        s if s.starts_with("53") => ErrorClass::Transient, // insufficient resources
        "57P01" | "57P02" | "57P03" | "57014" => ErrorClass::Transient, // shutdown, cancel/timeout
        "40001" | "40P01" => ErrorClass::Transient,        // serialization failure, deadlock
        "55P03" => ErrorClass::Transient,                  // lock not available
        s if s.starts_with("23") => ErrorClass::Constraint,
        "42P01" | "42703" | "3F000" => ErrorClass::Schema,
        _ => ErrorClass::Other,
    }
}

/// The rule a named constraint or index of `table` enforces, for error messages.
pub fn constraint_rule(table: &TableName, constraint: &str) -> String {
    let t = table.table();
    let rule = if constraint == format!("{t}_pkey") {
        "duplicate event id (primary key)"
    } else if constraint == format!("idx_{t}_idempotency_key") {
        "duplicate idempotency_key (R16)"
    } else if constraint == format!("ck_{t}_attempts_valid") {
        "attempts_made must not exceed max_attempts (R3)"
    } else if constraint == format!("ck_{t}_completed_status_consistency") {
        "completed_at is set exactly when status is 'completed' (R3)"
    } else if constraint == format!("ck_{t}_lock_consistency") {
        "locked_at and locked_by are both set or both null (R3)"
    } else {
        "a table constraint"
    };
    format!("{constraint}: {rule}")
}
