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

/// Which table a statement ran on, for [`missing_table_hint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableRole {
    /// An outbox table.
    Outbox,
    /// An inbox table.
    Inbox,
}

/// What to do about a missing table (or column) of `table`: the one hint of every driver's
/// [`ErrorClass::Schema`] error (`RepositoryError::Schema`), naming the function that creates
/// that kind of table on either store (R197). Driver errors are quoted by the server's message
/// alone, never with the server's source line.
pub fn missing_table_hint(table: &TableName, role: TableRole) -> String {
    match role {
        TableRole::Outbox => format!(
            "the outbox table {table} or a column of it is missing: create it with create_schema \
             (txoutbox_postgres::create_schema, or txoutbox_diesel::run_migrations) before starting"
        ),
        TableRole::Inbox => format!(
            "the inbox table {table} or a column of it is missing: create it with \
             create_inbox_schema (txoutbox_postgres::create_inbox_schema or \
             txoutbox_diesel::create_inbox_schema) before starting"
        ),
    }
}

/// Whether an error of this SQLSTATE is the database refusing a message's data rather than a
/// failure to try again (R132): class 22 (data exception) or class 23 (integrity constraint
/// violation). The inbox stores of every driver read their errors through this one test.
pub fn refuses_message(sqlstate: &str) -> bool {
    sqlstate.starts_with("22") || sqlstate.starts_with("23")
}

/// The SQLSTATE of a data exception (class 22) told by the server's message alone, for a driver
/// that hands over the message without its code: diesel-async keeps the code only as a kind
/// for class 23 and reports every class 22 error as `Unknown`. Recognises PostgreSQL's own
/// wording (English server messages, `lc_messages` C or en) of the data exceptions a landing or
/// an outcome write can meet: input that does not parse as a column's or a cast's type, a value
/// too long or out of range, an invalid byte sequence, an untranslatable character, a division
/// by zero. Any other message (a data exception a trigger raises with a wording of its own, a
/// translated server) gives none.
pub fn data_exception_from_message(message: &str) -> Option<&'static str> {
    const DATETIME_TYPES: [&str; 6] = [
        "timestamp",
        "timestamp with time zone",
        "date",
        "time",
        "time with time zone",
        "interval",
    ];
    if let Some(rest) = message.strip_prefix("invalid input syntax for type ") {
        let ty = rest.split(':').next().unwrap_or_default();
        return Some(if DATETIME_TYPES.contains(&ty) {
            "22007" // invalid_datetime_format
        } else {
            "22P02" // invalid_text_representation (json included)
        });
    }
    let starts = |p: &str| message.starts_with(p);
    if starts("value too long for type ") {
        Some("22001") // string_data_right_truncation
    } else if starts("date/time field value out of range")
        || starts("timestamp out of range")
        || starts("date out of range")
        || starts("interval out of range")
    {
        Some("22008") // datetime_field_overflow
    } else if starts("numeric field overflow")
        || starts("integer out of range")
        || starts("smallint out of range")
        || starts("bigint out of range")
        || starts("value out of range: ")
        || (starts("\"") && message.contains("\" is out of range for type "))
    {
        Some("22003") // numeric_value_out_of_range
    } else if starts("division by zero") {
        Some("22012") // division_by_zero
    } else if starts("invalid byte sequence for encoding ") {
        Some("22021") // character_not_in_repertoire
    } else if starts("unsupported Unicode escape sequence")
        || (starts("character with byte sequence ") && message.contains(" has no equivalent in "))
    {
        Some("22P05") // untranslatable_character
    } else {
        None
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
