//! SQL for the harnesses' own tables in a trial's schema (the writers' aggregates, the schema
//! drop), shared by the sqlx harness here and outbox-diesel's harness.

/// `CREATE TABLE IF NOT EXISTS "<schema>".aggregates (name text PRIMARY KEY)`: the
/// application lock table of the suite's writers.
pub fn create_aggregates(schema: &str) -> String {
    format!("CREATE TABLE IF NOT EXISTS \"{schema}\".aggregates (name text PRIMARY KEY)")
}

/// Takes the application lock of `$1 text` for the rest of the transaction: run
/// [`ensure_aggregate`] and then this.
pub fn lock_aggregate(schema: &str) -> String {
    format!("SELECT name FROM \"{schema}\".aggregates WHERE name = $1::text FOR UPDATE")
}

/// Inserts the aggregate row `$1 text` if missing (run in its own committed statement
/// first, so writers contend only on the row lock).
pub fn ensure_aggregate(schema: &str) -> String {
    format!("INSERT INTO \"{schema}\".aggregates (name) VALUES ($1::text) ON CONFLICT DO NOTHING")
}

/// `DROP SCHEMA IF EXISTS "<schema>" CASCADE`.
pub fn drop_schema(schema: &str) -> String {
    format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")
}
