//! The plan checks of the plan-stability tests (the outbox's `tests/fetch_plan.rs`, the
//! inbox's `tests/inbox_fetch_plan.rs`): a statement is explained with `EXPLAIN (ANALYZE,
//! BUFFERS, FORMAT JSON)` as a prepared statement in the session's plan-cache mode (so that a generic
//! plan is what a cached statement would run), and every node of its plan is checked:
//!
//! * no sequential scan of the table (or of one of its partitions);
//! * no node produces, or reads and filters out, more rows than [`PlanCheck::bound`] over all its
//!   loops;
//! * no scan of the table reads more buffers than [`PlanCheck::block_bound`], when set (rows a
//!   btree scan passes over inside the index, outside its start and stop keys, are in no row
//!   count);
//! * no sort spills to disk;
//! * the scans of the aliases [`Rules::by_id`] go through the primary key only;
//! * when [`Rules::uses`] is not empty, the scans of the table use exactly those indexes, all
//!   of them (an index of a partition counts as its parent's).
//!
//! The table's statistics are the test's business ([`Stats`]): its autovacuum is turned off, so
//! they stay as the test made them.

use std::collections::HashMap;

use serde_json::Value;
use sqlx::{AssertSqlSafe, PgConnection, Row};
use uuid::Uuid;

use txoutbox_postgres::sql::TableName;

/// The planner's statistics for the table of a plan check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stats {
    /// A fresh table filled without `ANALYZE` (the state after the schema creation and a
    /// burst).
    None,
    /// Analysed when it held a few completed rows (a quiet table), then filled (the state after
    /// a broker outage or a traffic burst).
    Stale,
    /// Analysed after the fill.
    Fresh,
}

/// What a plan must satisfy besides the common rules.
#[derive(Debug, Clone, Copy)]
pub struct Rules<'a> {
    /// The statement's name, for the messages.
    pub statement: &'a str,
    /// The aliases whose scans are lookups by id (they must use the primary key).
    pub by_id: &'a [&'a str],
    /// The indexes the statement's scans of the table use, exactly (empty: not checked).
    pub uses: &'a [&'a str],
}

impl<'a> Rules<'a> {
    /// Only the common rules.
    pub fn common(statement: &'a str) -> Self {
        Self {
            statement,
            by_id: &[],
            uses: &[],
        }
    }
}

/// The table a plan is checked against: its name, its partitions and their indexes.
#[derive(Debug, Clone)]
pub struct PlanCheck {
    table: TableName,
    relations: Vec<String>,
    parent_index: HashMap<String, String>,
    /// No plan node may produce (or, for a scan, read and filter out) more rows than this, over
    /// all its loops.
    pub bound: f64,
    /// No scan of the table may read more buffers (hit or read, over all its loops) than this;
    /// `None`: not checked.
    pub block_bound: Option<f64>,
}

/// `(partition, parent)` for the partitions of the table `$1` (schema.table), and for the
/// indexes on them.
const PARTITIONS: &str = "SELECT c.relname::text, p.relname::text
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  JOIN pg_class p ON p.oid = i.inhparent
 WHERE i.inhparent = $1::text::regclass
    OR i.inhparent IN (SELECT x.indexrelid FROM pg_index x WHERE x.indrelid = $1::text::regclass)";

impl PlanCheck {
    /// The check of plans on `table` (plain or partitioned), nodes bounded by `bound` rows.
    pub async fn load(conn: &mut PgConnection, table: &TableName, bound: f64) -> Self {
        let pairs: Vec<(String, String)> = sqlx::query(PARTITIONS)
            .bind(table.dotted())
            .fetch_all(&mut *conn)
            .await
            .expect("partitions")
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let mut relations = vec![table.table().to_owned()];
        let mut parent_index = HashMap::new();
        for (child, parent) in pairs {
            if parent == table.table() {
                relations.push(child);
            } else {
                parent_index.insert(child, parent);
            }
        }
        Self {
            table: table.clone(),
            relations,
            parent_index,
            bound,
            block_bound: None,
        }
    }

    /// The name of an index as the rules name it: a partition's index by its parent's name.
    fn index_name(&self, name: &str) -> String {
        self.parent_index
            .get(name)
            .cloned()
            .unwrap_or_else(|| name.to_owned())
    }

    /// Checks `node` and its children; returns the largest row count seen and adds the indexes
    /// the table's scans use to `used`.
    fn check_node(
        &self,
        node: &Value,
        rules: &Rules<'_>,
        ctx: &str,
        bad: &mut Vec<String>,
        used: &mut Vec<String>,
    ) -> f64 {
        let kind = node["Node Type"].as_str().unwrap_or("?");
        let on_table = node
            .get("Relation Name")
            .and_then(Value::as_str)
            .is_some_and(|r| self.relations.iter().any(|t| t == r));
        let alias = node.get("Alias").and_then(Value::as_str).unwrap_or("");
        let loops = number(node, "Actual Loops").max(1.0);
        let read = (number(node, "Actual Rows")
            + number(node, "Rows Removed by Filter")
            + number(node, "Rows Removed by Index Recheck"))
            * loops;
        let what = format!("{ctx}: {kind} {alias}");
        if on_table && kind == "Seq Scan" {
            bad.push(format!("{what}: a sequential scan of the table"));
        }
        if read > self.bound {
            bad.push(format!(
                "{what}: {read} rows over {loops} loops (bound {})",
                self.bound
            ));
        }
        if node.get("Sort Space Type").and_then(Value::as_str) == Some("Disk") {
            bad.push(format!("{what}: a sort spilled to disk"));
        }
        if on_table && kind.ends_with("Scan") {
            let blocks = number(node, "Shared Hit Blocks") + number(node, "Shared Read Blocks");
            if let Some(most) = self.block_bound.filter(|most| blocks > *most) {
                bad.push(format!(
                    "{what}: {blocks} buffers over {loops} loops (bound {most})"
                ));
            }
            let mut ix = Vec::new();
            index_names(node, &mut ix);
            let ix: Vec<String> = ix.iter().map(|i| self.index_name(i)).collect();
            if rules.by_id.contains(&alias) {
                let pkey = format!("{}_pkey", self.table.table());
                if ix.is_empty() || ix.iter().any(|i| *i != pkey) {
                    bad.push(format!(
                        "{what}: a lookup by id not through {pkey} but {ix:?}"
                    ));
                }
            }
            used.extend(ix);
        }
        let mut most = read;
        for c in node
            .get("Plans")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            most = most.max(self.check_node(c, rules, ctx, bad, used));
        }
        most
    }

    /// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of `text` as a prepared statement in the session's
    /// plan-cache mode, with the SQL literals `args` as its parameters, then the plan checked.
    /// Prints the execution time, the largest node's row count and the buffers read; returns what
    /// is wrong (with the plan), nothing when the plan passes.
    pub async fn explain(
        &self,
        conn: &mut PgConnection,
        rules: Rules<'_>,
        text: &str,
        args: &[String],
        ctx: &str,
    ) -> Vec<String> {
        exec(conn, &format!("PREPARE plan_check AS {text}")).await;
        let args = if args.is_empty() {
            String::new()
        } else {
            format!("({})", args.join(", "))
        };
        let plan: Value = sqlx::query(AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE plan_check{args}"
        )))
        .fetch_one(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{ctx} {}: explain: {e}", rules.statement))
        .try_get(0)
        .unwrap();
        exec(conn, "DEALLOCATE plan_check").await;
        let ctx = format!("{ctx} {}", rules.statement);
        let mut bad = Vec::new();
        let mut used = Vec::new();
        let most = self.check_node(&plan[0]["Plan"], &rules, &ctx, &mut bad, &mut used);
        if !rules.uses.is_empty() {
            used.sort();
            used.dedup();
            let mut want: Vec<String> = rules.uses.iter().map(|s| (*s).to_owned()).collect();
            want.sort();
            if used != want {
                bad.push(format!(
                    "{ctx}: the table read through {used:?}, not {want:?}"
                ));
            }
        }
        let root = &plan[0]["Plan"];
        eprintln!(
            "{ctx}: {:.1} ms, largest node {most} rows, {} buffers",
            number(&plan[0], "Execution Time"),
            number(root, "Shared Hit Blocks") + number(root, "Shared Read Blocks")
        );
        if !bad.is_empty() {
            bad.push(format!("{plan:#}"));
        }
        bad
    }
}

fn number(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

/// The indexes a scan reads: its own, or for a bitmap heap scan those of its bitmap children.
fn index_names(node: &Value, out: &mut Vec<String>) {
    if let Some(n) = node.get("Index Name").and_then(Value::as_str) {
        out.push(n.to_owned());
    }
    for c in node
        .get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if c["Node Type"]
            .as_str()
            .is_some_and(|k| k.starts_with("Bitmap"))
        {
            index_names(c, out);
        }
    }
}

/// A `uuid[]` literal.
pub fn uuids(ids: &[Uuid]) -> String {
    let v: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    format!("'{{{}}}'::uuid[]", v.join(","))
}

/// Runs `sql` (one or more statements, no parameters) on `conn`; panics when it fails.
pub async fn exec(conn: &mut PgConnection, sql: &str) {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}
