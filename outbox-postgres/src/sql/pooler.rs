//! The pooler mode (R194): how a store's statements run when a transaction-pooling proxy
//! (PgBouncer `pool_mode = transaction`) stands between it and PostgreSQL.
//!
//! Such a proxy hands the server connection back to its pool at the end of each transaction,
//! so a named prepared statement made in one transaction may be missing (or another client's)
//! in the next, and a lone extended-protocol statement (Parse … Sync, then Bind … Sync) may
//! have its halves run on two server connections. Under [`Pooler::Transaction`] every
//! statement text of a store starts with [`UNPREPARED`]; the drivers see that mark (the one
//! place each checks it: [`is_unprepared`]) and then
//!
//! - run the statement unnamed and uncached (sqlx: `persistent(false)`; diesel-async: not
//!   safe to cache, so the statement it names is closed before the transaction ends), and
//! - run it inside a transaction of its own when the connection is not in one already.
//!
//! The statements themselves keep no session state: `set_config(…, true)` (SET LOCAL) and
//! transaction-scoped advisory locks only. LISTEN needs a direct connection (R195), and so does
//! creating the schema (the migrations set a session `search_path` and take a session lock).

use std::fmt;
use std::str::FromStr;

/// How the store's connections reach PostgreSQL (R194).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooler {
    /// Directly, or through a session-pooling proxy: statements may be prepared and cached
    /// per connection (the default).
    #[default]
    None,
    /// Through a transaction-pooling proxy (PgBouncer `pool_mode = transaction`): no prepared
    /// statement outlives its transaction, and every statement runs inside a transaction.
    Transaction,
}

impl Pooler {
    /// The setting's name as the binaries take it (`none`, `transaction`).
    pub fn as_str(self) -> &'static str {
        match self {
            Pooler::None => "none",
            Pooler::Transaction => "transaction",
        }
    }
}

impl fmt::Display for Pooler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Pooler {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "" => Ok(Pooler::None),
            "transaction" => Ok(Pooler::Transaction),
            other => Err(format!(
                "pooler must be `none` (a direct connection or a session-pooling proxy) or `transaction` (a transaction-pooling proxy such as PgBouncer's pool_mode = transaction), got `{other}`"
            )),
        }
    }
}

/// The comment that starts every statement text of a store under [`Pooler::Transaction`].
pub const UNPREPARED: &str = "/* txoutbox pooler=transaction */ ";

/// Whether `sql` is a statement of a store under [`Pooler::Transaction`]: run it unnamed and
/// uncached, inside a transaction.
pub fn is_unprepared(sql: &str) -> bool {
    sql.starts_with(UNPREPARED)
}

/// Marks `sql` for `pooler` (nothing for [`Pooler::None`]; idempotent).
pub fn mark(sql: &mut String, pooler: Pooler) {
    if pooler == Pooler::Transaction && !is_unprepared(sql) {
        sql.insert_str(0, UNPREPARED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_marks() {
        assert_eq!("transaction".parse::<Pooler>(), Ok(Pooler::Transaction));
        assert_eq!("none".parse::<Pooler>(), Ok(Pooler::None));
        assert!(
            "session"
                .parse::<Pooler>()
                .unwrap_err()
                .contains("got `session`")
        );
        let mut s = "SELECT 1".to_owned();
        mark(&mut s, Pooler::None);
        assert!(!is_unprepared(&s));
        mark(&mut s, Pooler::Transaction);
        mark(&mut s, Pooler::Transaction);
        assert_eq!(s, format!("{UNPREPARED}SELECT 1"));
        assert!(is_unprepared(&s));
    }
}
