//! Server-side prepared statements for the shared statement texts.
//!
//! diesel never caches a `sql_query` (it marks every one unsafe to cache), so each call would
//! be parsed and planned again; the fetch alone plans in about 6 ms, more than its execution.
//! The outbox statements are fixed texts per table ([`txoutbox_postgres::sql::Statements`], the
//! table name validated before it reaches SQL) with every value bound, so caching them by SQL
//! text and bind types is sound. [`Prepared`] says so: diesel-async then prepares each text
//! once per connection and reuses it, and PostgreSQL switches to a generic plan after a few
//! executions, as it does for the sqlx backend's persistent statements.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::QueryResult;

/// A query whose SQL text is fixed for the life of the process (built from a validated table
/// name, values bound), safe for diesel's per-connection statement cache — unless the second
/// field says not to cache it: a statement of a store behind a transaction-pooling proxy
/// (R194, `txoutbox_postgres::sql::pooler`), which diesel-async then prepares for its one
/// execution and closes at once, inside its transaction.
#[derive(Debug)]
pub(crate) struct Prepared<Q>(pub(crate) Q, pub(crate) bool);

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for Prepared<Q> {
    fn walk_ast<'b>(&'b self, pass: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.0.walk_ast(pass)
    }

    fn is_safe_to_cache_prepared(&self, _backend: &Pg) -> QueryResult<bool> {
        Ok(self.1)
    }
}

impl<Q> QueryId for Prepared<Q> {
    type QueryId = ();
    // No static id: the cache key is the SQL text with the bind types.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q: Query> Query for Prepared<Q> {
    type SqlType = Q::SqlType;
}
