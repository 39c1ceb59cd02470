//! The backlog shapes of the fetch benchmark and the plan test (the fetch must stay flat
//! whatever the backlog), built with plain SQL in the given table.

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPool;

use txoutbox_postgres::sql::TableName;

/// A backlog shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// (a) 20,000 pending over 1,000 keys.
    A,
    /// (b) 100,000 pending, one row per key.
    B,
    /// (c) one key with 100,000 pending (written first) plus 1,000 other keys (5 rows each).
    C,
    /// (d) (a) plus 3,000,000 completed rows.
    D,
    /// (e) (a) with 10% of the rows locked by a crashed worker whose lease expired.
    E,
    /// (f) one key whose head waits for a retry an hour later with 10,000 rows behind it,
    /// plus 100,000 keys of one due row each, all newer.
    F,
    /// (g) 100 keys like (f)'s with 1,000 rows behind each, plus 10,000 keys of one row.
    G,
    /// One key `stuck` whose head waits for a retry an hour later (attempts_made 1) with
    /// `behind` due rows behind it, then `keys` keys of one due row each, all newer (the
    /// shape of PG-11, at a size a test picks).
    Stuck {
        /// Rows behind the blocked head.
        behind: u64,
        /// One-row keys written after them.
        keys: u64,
    },
}

impl Shape {
    /// All shapes.
    pub const ALL: [Shape; 7] = [
        Shape::A,
        Shape::B,
        Shape::C,
        Shape::D,
        Shape::E,
        Shape::F,
        Shape::G,
    ];

    /// A one-line description.
    pub fn describe(self) -> &'static str {
        match self {
            Shape::A => "(a) 20,000 pending over 1,000 keys",
            Shape::B => "(b) 100,000 pending, one per key",
            Shape::C => "(c) one key with 100,000 pending + 1,000 other keys",
            Shape::D => "(d) (a) + 3,000,000 completed",
            Shape::E => "(e) (a) with 10% held by a crashed worker (lease expired)",
            Shape::F => "(f) a blocked key with 10,000 behind + 100,000 one-row keys",
            Shape::G => "(g) 100 blocked keys with 1,000 behind each + 10,000 one-row keys",
            Shape::Stuck { .. } => "a blocked key with rows behind + one-row keys",
        }
    }
}

/// `n` rows: key of row g is `key_expr` (SQL over g), created_at = base + g ms, all due.
fn insert(t: &TableName, n: u64, key_expr: &str, status: &str, base: &str) -> String {
    let completed = if status == "completed" {
        "ts + interval '1 second'"
    } else {
        "NULL"
    };
    format!(
        "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, scheduled_at, \
         completed_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
         SELECT gen_random_uuid(), 'bench.event', '{{\"n\": 1}}', '{status}', 0, 6, ts, {completed}, ts, ts, \
                'agg', gen_random_uuid(), 'bench', {key_expr} \
           FROM generate_series(1, {n}) g, \
                LATERAL (SELECT now() - interval '{base}' + g * interval '1 millisecond' AS ts) x",
        q = t.qualified()
    )
}

/// `n` heads blocked by a counted failure (attempts_made 1, last_error set, next try an
/// hour after now), key of row g = `key_expr`, created_at = base + g ms.
fn insert_blocked(t: &TableName, n: u64, key_expr: &str, base: &str) -> String {
    format!(
        "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, last_error, \
         scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
         SELECT gen_random_uuid(), 'bench.event', '{{\"n\": 1}}', 'pending', 1, 6, 'broker said no', \
                now() + interval '1 hour', ts, ts, 'agg', gen_random_uuid(), 'bench', {key_expr} \
           FROM generate_series(1, {n}) g, \
                LATERAL (SELECT now() - interval '{base}' + g * interval '1 millisecond' AS ts) x",
        q = t.qualified()
    )
}

/// Fills the (empty) table with `shape` and analyzes it.
pub async fn build(pool: &PgPool, t: &TableName, shape: Shape) -> Result<(), sqlx::Error> {
    let mut stmts = Vec::new();
    let a = || {
        insert(
            t,
            20_000,
            "'k' || (hashint4(g::int4) & 1023) % 1000",
            "pending",
            "1 hour",
        )
    };
    match shape {
        Shape::A => stmts.push(a()),
        Shape::B => stmts.push(insert(t, 100_000, "'k' || g", "pending", "1 hour")),
        Shape::C => {
            stmts.push(insert(t, 100_000, "'hot'", "pending", "3 hours"));
            stmts.push(insert(t, 5_000, "'k' || (g % 1000)", "pending", "1 hour"));
        }
        Shape::D => {
            stmts.push(insert(
                t,
                3_000_000,
                "'k' || (g % 1000)",
                "completed",
                "40 days",
            ));
            stmts.push(a());
        }
        Shape::E => {
            stmts.push(a());
            stmts.push(format!(
                "UPDATE {q} SET locked_at = now() - interval '10 minutes', locked_by = 'crashed-relay' \
                 WHERE hashint4(extract(epoch FROM created_at)::int4 # hashtext(id::text)) % 10 = 0",
                q = t.qualified()
            ));
        }
        Shape::F => {
            stmts.push(insert_blocked(t, 1, "'stuck'", "5 hours"));
            stmts.push(insert(t, 10_000, "'stuck'", "pending", "4 hours"));
            stmts.push(insert(t, 100_000, "'k' || g", "pending", "1 hour"));
        }
        Shape::G => {
            stmts.push(insert_blocked(t, 100, "'stuck' || g", "5 hours"));
            stmts.push(insert(
                t,
                100_000,
                "'stuck' || (g % 100 + 1)",
                "pending",
                "4 hours",
            ));
            stmts.push(insert(t, 10_000, "'k' || g", "pending", "1 hour"));
        }
        Shape::Stuck { behind, keys } => {
            stmts.push(insert_blocked(t, 1, "'stuck'", "5 hours"));
            stmts.push(insert(t, behind, "'stuck'", "pending", "4 hours"));
            stmts.push(insert(t, keys, "'k' || g", "pending", "1 hour"));
        }
    }
    stmts.push(format!("ANALYZE {}", t.qualified()));
    for s in stmts {
        sqlx::raw_sql(AssertSqlSafe(s)).execute(pool).await?;
    }
    Ok(())
}
