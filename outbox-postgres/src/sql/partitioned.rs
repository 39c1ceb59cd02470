//! The partitioned layout (issue #3): the outbox table `PARTITION BY RANGE (created_at)`, like
//! the ancestor's `outbox_events_partitioned`, with the same rules as the plain table.
//!
//! # The table
//!
//! The same 23 columns with the same types, lengths, nullability and defaults, and the same
//! three CHECK constraints as Appendix A. Two differences, both forced by PostgreSQL (a unique
//! constraint of a partitioned table must contain the partition key):
//!
//! * the primary key `<t>_pkey` is `(id, created_at)` instead of `(id)`;
//! * `idx_<t>_idempotency_key` is a plain (non-unique) partial index, so the database no longer
//!   enforces R16 by itself: the writers do, under per-key advisory locks (below).
//!
//! The other six indexes, and the additions (`super::additions`), have the same names and
//! definitions; they are created on the parent, so every partition gets them. The partitions are a DEFAULT partition `<t>_default` (rows
//! outside every monthly range: the past, the far future, rows moved by a test clock) and one
//! partition per calendar month (UTC) `<t>_pYYYYMM`, `[first of the month, first of the next)`,
//! created by [`ensure_partitions`] from the current month (database clock) through
//! `months_ahead` months ahead. A table name is at most 31 characters (R78), so every derived
//! name fits PostgreSQL's 63 bytes.
//!
//! # Idempotency (R16, R17)
//!
//! Before inserting, a write call takes `pg_advisory_xact_lock` on a 64-bit hash of the key,
//! seeded with the table's OID (so writers that name one table differently, `t` and
//! `public.t`, share the locks), for each distinct idempotency key of the call, in sorted
//! order (two calls with overlapping keys lock in the same order, so they cannot deadlock)
//! ([`idempotency_lock`]). The locks are held until the caller's transaction ends. Then, as its
//! own statement (so, under READ COMMITTED, with a snapshot taken after the locks were granted),
//! the insert ([`insert`]) skips every event whose idempotency key or id is already stored, and
//! [`select_existing`] reads those rows. A second writer of a key therefore waits for the first
//! transaction and then sees its committed row (or, after a rollback, inserts its own).
//!
//! This needs a snapshot per statement: under REPEATABLE READ the transaction's snapshot may
//! predate the other writer's commit, so the writers refuse to write keys there
//! (`shared::check_write_isolation`); READ COMMITTED (PostgreSQL's default) and SERIALIZABLE
//! (whose conflict detection aborts one of two such writers) are accepted.
//!
//! # Limits
//!
//! * Rows that a writer inserted without these locks (plain SQL, or a writer configured with
//!   the plain layout) can duplicate a key: the database does not prevent it. When a key is
//!   stored more than once, a write returns its oldest row (by `(created_at, id)`).
//! * The id check of the insert probes the primary key of every partition (created_at of an
//!   existing row is unknown), so keep the number of partitions moderate (drop or detach old
//!   months once their rows are completed and cleaned up).
//! * Creating a partition locks the table briefly; run [`ensure_partitions`] at a regular quiet
//!   moment (daily is plenty) so next month's partition exists before its rows arrive. Rows
//!   that arrive first land in the default partition, and a monthly partition whose range
//!   already has rows there cannot be created: [`ensure_partitions`] then fails with a message
//!   naming the partition and the row count, and changes nothing.
//! * `create_key_order_index_concurrently` does not apply (PostgreSQL cannot build an index
//!   concurrently on a partitioned parent); the layout is for new tables, and a plain table is
//!   never converted.

use std::collections::BTreeSet;
use std::fmt;

use txoutbox_core::event::NewEvent;

use super::{
    IndexDef, TableName, WritePlan, additions, column_list, create_index, create_table, indexes,
    insert_statement,
};
use crate::error::Error;

/// How the outbox table is laid out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// One table, Appendix A exactly (the default).
    #[default]
    Plain,
    /// `PARTITION BY RANGE (created_at)` with monthly partitions and a default partition; see
    /// the [module docs](self).
    Partitioned,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Layout::Plain => "plain",
            Layout::Partitioned => "partitioned",
        })
    }
}

/// Months ahead of the current one that schema creation makes partitions for.
pub const DEFAULT_MONTHS_AHEAD: u32 = 3;
/// The most months ahead [`ensure_partitions`] accepts (ten years).
pub const MONTHS_AHEAD_MAX: u32 = 120;

/// Checks a months-ahead count: 0 (only the current month) to [`MONTHS_AHEAD_MAX`].
pub fn check_months_ahead(months_ahead: u32) -> Result<u32, Error> {
    if months_ahead > MONTHS_AHEAD_MAX {
        return Err(Error::Partitions(format!(
            "months_ahead is {months_ahead}; the limit is {MONTHS_AHEAD_MAX} (partitions are monthly, make them at most ten years ahead)"
        )));
    }
    Ok(months_ahead)
}

/// The default partition's bare name: `<t>_default`.
pub fn default_partition(table: &TableName) -> String {
    table.derived("", "_default")
}

/// The bare name of the monthly partition of `year`-`month`: `<t>_pYYYYMM`.
pub fn month_partition(table: &TableName, year: i32, month: u32) -> String {
    table.derived("", &format!("_p{year:04}{month:02}"))
}

/// A bare name in the table's schema, quoted (`"s"."n"` or `"n"`).
fn sibling(table: &TableName, name: &str) -> String {
    match table.schema() {
        Some(s) => format!("\"{s}\".\"{name}\""),
        None => format!("\"{name}\""),
    }
}

/// The seven indexes of Appendix A for the partitioned table: the same names and bodies, but
/// `idx_<t>_idempotency_key` is not unique (see the module docs).
pub fn partitioned_indexes(table: &TableName) -> Vec<IndexDef> {
    indexes(table)
        .into_iter()
        .map(|ix| IndexDef {
            unique: false,
            ..ix
        })
        .collect()
}

/// A `DO` block that fails, changing nothing, when `table` exists but is not partitioned (a
/// plain outbox table is never converted).
fn refuse_plain(table: &TableName) -> String {
    format!(
        "DO $outbox$
DECLARE k \"char\";
BEGIN
  SELECT c.relkind INTO k FROM pg_class c WHERE c.oid = to_regclass('{q}');
  IF k IS NOT NULL AND k <> 'p' THEN
    RAISE EXCEPTION 'the outbox table {d} exists and is not partitioned, so the partitioned layout cannot use it (a table is never converted): use the plain layout for it, or give the partitioned table another name'
      USING ERRCODE = '42809';
  END IF;
END
$outbox$",
        q = table.qualified(),
        d = table.dotted(),
    )
}

/// The partitioned schema, as statements to run in order in one transaction after
/// [`super::Statements::schema_lock`] (like [`super::ddl`]): `CREATE SCHEMA IF NOT EXISTS`
/// (when qualified), a check that refuses an existing plain table, `CREATE TABLE IF NOT EXISTS
/// … PARTITION BY RANGE (created_at)`, the default partition, the seven indexes and the
/// additions on the parent, and [`ensure_partitions`] for the current month and
/// `months_ahead` more. Idempotent.
pub fn ddl(table: &TableName, months_ahead: u32) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(s) = table.schema() {
        v.push(format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""));
    }
    v.push(refuse_plain(table));
    v.push(create_table(table, true, Layout::Partitioned));
    v.push(format!(
        "CREATE TABLE IF NOT EXISTS {p} PARTITION OF {q} DEFAULT",
        p = sibling(table, &default_partition(table)),
        q = table.qualified()
    ));
    for ix in partitioned_indexes(table)
        .into_iter()
        .chain(additions(table))
    {
        v.push(create_index(table, &ix, true, false));
    }
    v.push(ensure_partitions(table, months_ahead));
    v
}

/// One `DO` block (no parameters; run it after [`super::Statements::schema_lock`], in a
/// transaction) that creates every missing monthly partition `<t>_pYYYYMM` from the current
/// month of the database clock (UTC months) through `months_ahead` months ahead, in the
/// parent's schema. An existing partition of that name is left alone. When the default
/// partition already holds rows in a missing month's range, it raises an error naming the
/// partition, the range and the row count (PostgreSQL could not create the partition: those
/// rows would belong to it) and, the transaction failing, creates nothing. Call
/// [`check_months_ahead`] first.
pub fn ensure_partitions(table: &TableName, months_ahead: u32) -> String {
    format!(
        "DO $outbox$
DECLARE
  parent regclass := '{q}'::regclass;
  sch text;
  base timestamp := date_trunc('month', now() AT TIME ZONE 'UTC');
  lo timestamp;
  part text;
  n bigint;
BEGIN
  SELECT ns.nspname INTO sch FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
   WHERE c.oid = parent;
  FOR i IN 0..{months_ahead} LOOP
    lo := base + make_interval(months => i);
    part := '{t}_p' || to_char(lo, 'YYYYMM');
    IF to_regclass(format('%I.%I', sch, part)) IS NULL THEN
      EXECUTE format('SELECT count(*) FROM %I.%I WHERE created_at >= $1 AND created_at < $2',
                     sch, '{dp}')
         INTO n USING lo AT TIME ZONE 'UTC', (lo + interval '1 month') AT TIME ZONE 'UTC';
      IF n > 0 THEN
        RAISE EXCEPTION 'cannot create the outbox partition %.% for created_at in [% UTC, % UTC): the default partition %.% already holds % rows of that range; move them out first (detach %.% from the parent, create the partition, insert those rows through the parent, delete them from %.%, attach it again) or create partitions before their month begins',
          sch, part, lo, lo + interval '1 month', sch, '{dp}', n, sch, '{dp}', sch, '{dp}'
          USING ERRCODE = '55000';
      END IF;
      EXECUTE format('CREATE TABLE %I.%I PARTITION OF %s FOR VALUES FROM (%L) TO (%L)',
                     sch, part, parent, lo AT TIME ZONE 'UTC',
                     (lo + interval '1 month') AT TIME ZONE 'UTC');
    END IF;
  END LOOP;
END
$outbox$",
        q = table.qualified(),
        t = table.table(),
        dp = default_partition(table),
    )
}

/// [`super::Statements::idempotency_lock`] for `table`: `$1 text[]` sorted distinct keys;
/// one row `isolation text`.
pub fn idempotency_lock(table: &TableName) -> String {
    // The sub-select's ORDER BY keeps it from being flattened, so the aggregate sees (and
    // locks) the keys in order; an aggregate argument is evaluated for every input row.
    format!(
        "SELECT current_setting('transaction_isolation')::text AS isolation,
       count(pg_advisory_xact_lock(hashtextextended(s.k, '{q}'::regclass::oid::int8))::text)
         AS locked
  FROM (SELECT u.k FROM unnest($1::text[]) WITH ORDINALITY AS u(k, o) ORDER BY u.o) s",
        q = table.qualified()
    )
}

/// [`super::Statements::insert`] of the partitioned layout: the same parameters and result,
/// and it inserts only events whose id and idempotency key are not stored yet (run it after
/// [`idempotency_lock`], as its own statement).
pub fn insert(table: &TableName) -> String {
    let t = table.qualified();
    insert_statement(
        &t,
        &column_list(""),
        &format!(
            "
 WHERE NOT EXISTS (SELECT 1 FROM {t} e WHERE e.id = u.id)
   AND (u.idempotency_key IS NULL
        OR NOT EXISTS (SELECT 1 FROM {t} e WHERE e.idempotency_key = u.idempotency_key))"
        ),
    )
}

/// [`super::Statements::select_existing`] of the partitioned layout: the same parameters and
/// columns, but for a key stored more than once (rows written without the locks) only its
/// oldest row by `(created_at, id)`, and no row matched by id whose key is among `$2`.
pub fn select_existing(table: &TableName) -> String {
    let t = table.qualified();
    let cols = column_list("");
    let cols_k = column_list("k");
    format!(
        "SELECT {cols_k} FROM (
    SELECT DISTINCT ON (idempotency_key) {cols} FROM {t}
     WHERE idempotency_key = ANY($2::text[])
     ORDER BY idempotency_key, created_at, id) k
UNION ALL
SELECT {cols} FROM {t}
 WHERE id = ANY($1::uuid[])
   AND (idempotency_key IS NULL OR NOT (idempotency_key = ANY($2::text[])))"
    )
}

/// The distinct idempotency keys of the events a write call inserts, sorted: `$1` of
/// [`idempotency_lock`]. Empty when no event has a key (then no lock is needed).
pub fn lock_keys(events: &[NewEvent], plan: &WritePlan) -> Vec<String> {
    plan.unique
        .iter()
        .filter_map(|&i| events[i].idempotency_key())
        .collect::<BTreeSet<&str>>()
        .into_iter()
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitioned_ddl_keeps_names_and_partitions_by_created_at() {
        let t = TableName::new("ops.my_outbox").unwrap();
        let ddl = ddl(&t, 3).join(";\n");
        assert!(ddl.contains("PARTITION BY RANGE (created_at)"), "{ddl}");
        assert!(ddl.contains("PRIMARY KEY (id, created_at)"), "{ddl}");
        assert!(ddl.contains("\"ops\".\"my_outbox_default\" PARTITION OF \"ops\".\"my_outbox\""));
        assert!(ddl.contains("CREATE INDEX IF NOT EXISTS \"idx_my_outbox_idempotency_key\""));
        assert!(!ddl.contains("UNIQUE"), "{ddl}");
        assert!(ddl.contains("\"idx_my_outbox_pending_key_order\" ON \"ops\".\"my_outbox\""));
        assert!(ddl.contains("FOR i IN 0..3 LOOP"));
        assert!(!ddl.contains("outbox_events"));
    }

    #[test]
    fn derived_partition_names_fit_postgres() {
        let t = TableName::new(&"a".repeat(31)).unwrap();
        assert!(default_partition(&t).len() <= 63);
        assert_eq!(month_partition(&t, 2025, 1).len(), 31 + 8);
        assert!(month_partition(&t, 2025, 1).ends_with("_p202501"));
    }

    #[test]
    fn months_ahead_is_bounded() {
        assert!(check_months_ahead(0).is_ok());
        assert!(check_months_ahead(MONTHS_AHEAD_MAX).is_ok());
        assert!(check_months_ahead(MONTHS_AHEAD_MAX + 1).is_err());
    }

    #[test]
    fn lock_keys_are_distinct_and_sorted() {
        let ev = |k: Option<&str>| {
            let b = NewEvent::builder()
                .topic("t")
                .partition_key("k")
                .event_type("e")
                .payload_json(serde_json::json!({"n": 1}))
                .aggregate("a", uuid::Uuid::new_v4());
            match k {
                Some(k) => b.idempotency_key(k),
                None => b,
            }
            .build()
            .unwrap()
        };
        let events = vec![ev(Some("b")), ev(None), ev(Some("a")), ev(Some("b"))];
        let plan = super::super::dedupe_write(&events);
        assert_eq!(lock_keys(&events, &plan), vec!["a", "b"]);
        assert!(lock_keys(&events[1..2], &super::super::dedupe_write(&events[1..2])).is_empty());
    }
}
