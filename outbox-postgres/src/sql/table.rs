//! The table: its validated name and its columns.

use super::*;

/// The default table name (the ancestor's).
pub const DEFAULT_TABLE: &str = "outbox_events";
/// Longest table name (R78): every derived constraint and index name then fits 63 bytes.
pub const TABLE_NAME_MAX: usize = 31;
/// Longest schema name (R78).
pub const SCHEMA_NAME_MAX: usize = 63;

// ---------------------------------------------------------------------------------------------
// Table name
// ---------------------------------------------------------------------------------------------

/// A validated table name, optionally schema-qualified (R78): each part matches
/// `^[a-z_][a-z0-9_]*$`, the table at most 31 characters, the schema at most 63.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

pub(super) fn check_ident(part: &str, max: usize, what: &str, whole: &str) -> Result<(), Error> {
    let err = |reason: String| Error::TableName {
        name: whole.to_owned(),
        reason,
    };
    if part.is_empty() {
        return Err(err(format!("the {what} name is empty")));
    }
    let n = part.chars().count();
    if n > max {
        return Err(err(format!(
            "the {what} name is {n} characters long; the limit is {max}"
        )));
    }
    let mut chars = part.chars();
    let first = chars.next().expect("not empty");
    if !(first.is_ascii_lowercase() || first == '_') {
        return Err(err(format!(
            "the {what} name must start with a lowercase ASCII letter or '_', got {first:?}"
        )));
    }
    if let Some(bad) = chars.find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'))
    {
        return Err(err(format!(
            "the {what} name may hold only lowercase ASCII letters, digits and '_', got {bad:?}"
        )));
    }
    Ok(())
}

impl TableName {
    /// Validates `name`, either `table` or `schema.table` (R78; PG-03).
    pub fn new(name: &str) -> Result<Self, Error> {
        let parts: Vec<&str> = name.split('.').collect();
        match parts.as_slice() {
            [table] => {
                check_ident(table, TABLE_NAME_MAX, "table", name)?;
                Ok(Self {
                    schema: None,
                    table: (*table).to_owned(),
                })
            }
            [schema, table] => {
                check_ident(schema, SCHEMA_NAME_MAX, "schema", name)?;
                check_ident(table, TABLE_NAME_MAX, "table", name)?;
                Ok(Self {
                    schema: Some((*schema).to_owned()),
                    table: (*table).to_owned(),
                })
            }
            _ => Err(Error::TableName {
                name: name.to_owned(),
                reason: "at most one '.' (schema.table) is allowed".into(),
            }),
        }
    }

    /// The same table name in another schema (validated the same way).
    pub fn in_schema(&self, schema: &str) -> Result<Self, Error> {
        Self::new(&format!("{schema}.{}", self.table))
    }

    /// The bare table name, from which constraint and index names derive.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The schema, when qualified.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The name as SQL: `"table"` or `"schema"."table"` (quoted; safe because validated).
    pub fn qualified(&self) -> String {
        match &self.schema {
            Some(s) => format!("\"{s}\".\"{}\"", self.table),
            None => format!("\"{}\"", self.table),
        }
    }

    /// A derived object name: `prefix` + table + `suffix`, e.g. `idx_` + `outbox_events` +
    /// `_created_at` (bare, as stored in the catalog).
    pub fn derived(&self, prefix: &str, suffix: &str) -> String {
        format!("{prefix}{}{suffix}", self.table)
    }

    /// The text given to `regclass`/catalog lookups: `schema.table` or `table`.
    pub fn dotted(&self) -> String {
        match &self.schema {
            Some(s) => format!("{s}.{}", self.table),
            None => self.table.clone(),
        }
    }

    /// The LISTEN/NOTIFY channel of the table: `outbox.` + [`TableName::dotted`] when that fits
    /// PostgreSQL's 63-byte channel names, else `outbox.` + a stable 64-bit FNV-1a hash of the
    /// dotted name in hex. Writers built with `notify` send on it; `outbox-relay run` listens
    /// on it. The payload is empty: a notification only means "look now", and PostgreSQL folds
    /// the identical notifications of one transaction into one.
    pub fn notify_channel(&self) -> String {
        let dotted = self.dotted();
        let name = format!("outbox.{dotted}");
        if name.len() <= 63 {
            return name;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in dotted.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("outbox.{h:016x}")
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.dotted())
    }
}

impl std::str::FromStr for TableName {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::new(s)
    }
}

// ---------------------------------------------------------------------------------------------
// DDL (contract Appendix A)
// ---------------------------------------------------------------------------------------------

/// The columns of the table, in DDL order; every row-returning statement returns these.
pub const COLUMNS: [&str; 23] = [
    "id",
    "event_type",
    "payload",
    "headers",
    "trace_id",
    "idempotency_key",
    "correlation_id",
    "causation_id",
    "schema_version",
    "status",
    "attempts_made",
    "max_attempts",
    "last_error",
    "scheduled_at",
    "completed_at",
    "locked_at",
    "locked_by",
    "created_at",
    "updated_at",
    "aggregate_type",
    "aggregate_id",
    "topic",
    "partition_key",
];

/// `COLUMNS` joined with `, `, each prefixed by `alias.` when `alias` is not empty.
pub fn column_list(alias: &str) -> String {
    COLUMNS
        .iter()
        .map(|c| {
            if alias.is_empty() {
                (*c).to_owned()
            } else {
                format!("{alias}.{c}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}
