//! The one home of the Postgres SQL, shared by the sqlx backend of this crate and by
//! `outbox-diesel`. This module compiles without the `sqlx` feature and has no driver types in
//! its API: statement texts are plain `String`s with numbered bind parameters (`$1`, `$2`, …),
//! and every statement documents its parameters (order and Postgres type) and its result
//! columns.
//!
//! # Use
//!
//! 1. Validate the table name: [`TableName::new`] (R78). Only a validated name ever reaches SQL,
//!    always double-quoted; every value is a bound parameter.
//! 2. Create the schema with the statements of [`ddl`], in order, in one transaction (they are
//!    idempotent; on an existing ancestor table they add only what is missing, R79), after
//!    taking the advisory lock [`Statements::schema_lock`].
//! 3. Build [`Statements::new`] once and run its texts.
//!
//! # Bind types
//!
//! `uuid`, `text`, `int4`, `int8`, `bool`, `timestamptz`, and arrays of them (`uuid[]`, `text[]`,
//! …; array elements may be NULL where a statement says so). JSON goes in as `text` and is cast
//! in SQL (`::jsonb`), so a driver needs no JSON support to bind it. Durations are bound as
//! `int8` microseconds and turned into intervals in SQL (`$n * INTERVAL '1 microsecond'`), so
//! every time is computed on the database clock (R72).
//!
//! # Row mapping
//!
//! Every statement that returns outbox rows returns exactly the columns of [`COLUMNS`], in that
//! order (the DDL's column order). Decode them into a [`RawRow`] (the Rust type for each column
//! is given on its field) and call [`RawRow::decode`], which never fails the whole fetch: a row
//! whose headers are not a string map, or whose status is not one of the three values, becomes
//! an [`UndecodableRow`] (R82).
//!
//! # The fetch
//!
//! Two statements in one transaction: [`Statements::fetch_heads`] chooses the candidate heads
//! (path A, a window of the oldest fetchable rows read with `SKIP LOCKED`; path B, a key walk
//! bounded by the batch that resumes from a [`WalkCursor`]), then [`Statements::fetch_take`]
//! locks them in head order until the batch is full, extends them into runs and stamps the
//! lease (R19–R29, R74, R76, R85); [`Statements::fetch_take_transaction`] is the same without
//! the stamp, for delivery in one transaction (R84). The sqlx backend runs them with
//! `fetch_rows`, outbox-diesel with its own driver calls. They use the indexes of Appendix A
//! and the [`additions`], take no advisory lock, and their work is bounded by the batch
//! whatever the backlog and whatever the planner's statistics (every lookup by id goes through
//! the primary key; see `fragments` and the crate README, "Plan-stable statements").
//!
//! # Where the SQL lives
//!
//! Each statement is a file under `src/sql/statements/` (`fetch_heads.sql`, `fetch_take.sql`,
//! `blocked_keys.sql`, …) with its parameters and result columns documented at its top,
//! included at compile time; `{table}` is replaced by the validated, quoted table name.
//! Predicates shared by several statements are files under `src/sql/fragments/`, composed in
//! as `{name:alias}` when the statements are built. The DDL and the insert stay in Rust
//! because they are assembled per layout.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::event::{NewEvent, OutboxEvent, Status};
use outbox_core::repository::{FetchRequest, UndecodableRow};
use uuid::Uuid;

use crate::error::Error;

pub(crate) mod fragments;
pub mod partitioned;
pub use partitioned::Layout;

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

fn check_ident(part: &str, max: usize, what: &str, whole: &str) -> Result<(), Error> {
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

/// One index of the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexDef {
    /// The index name as stored in the catalog, e.g. `idx_outbox_events_created_at`.
    pub name: String,
    /// Whether it is unique.
    pub unique: bool,
    /// The part after `ON <table>`: columns and predicate, e.g. `(created_at)`.
    pub body: String,
}

/// The seven indexes of Appendix A, in its order, for `table`. `pending_key_order` (R33) is
/// among them. The library also creates the [`additions`].
pub fn indexes(table: &TableName) -> Vec<IndexDef> {
    let i = |suffix: &str, unique: bool, body: &str| IndexDef {
        name: table.derived("idx_", suffix),
        unique,
        body: body.to_owned(),
    };
    vec![
        i(
            "_completed_cleanup",
            false,
            "(completed_at) WHERE status = 'completed' AND completed_at IS NOT NULL",
        ),
        i("_created_at", false, "(created_at)"),
        i(
            "_idempotency_key",
            true,
            "(idempotency_key) WHERE idempotency_key IS NOT NULL",
        ),
        i(
            "_locked_at",
            false,
            "(locked_at) WHERE locked_at IS NOT NULL",
        ),
        i(
            "_pending_fetch",
            false,
            "(scheduled_at) WHERE status = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts",
        ),
        i(
            "_pending_key_order",
            false,
            "(topic, partition_key, created_at) WHERE status = 'pending'",
        ),
        i("_updated_at", false, "(updated_at)"),
    ]
}

/// The additive indexes the library creates beside Appendix A's (R78, Appendix A
/// "Additions"), in creation order: `idx_<t>_pending_window` on `(scheduled_at, created_at,
/// id)` over the unlocked pending rows with attempts left, whose order is the fetch window's
/// `ORDER BY` (so the window is one ordered index read bounded by its `LIMIT`, whatever the
/// planner's statistics say; its predicate is the `window` fragment, written so that it is
/// the only index the window can use). Maintained by PostgreSQL like any index; a row that
/// omni-box 0.3.1 or plain SQL writes is indexed like any other, and omni-box's relay does not
/// depend on it.
pub fn additions(table: &TableName) -> Vec<IndexDef> {
    vec![IndexDef {
        name: window_index(table),
        unique: false,
        body: format!(
            "(scheduled_at, created_at, id) WHERE {}",
            fragments::fragment("window", "")
        ),
    }]
}

/// The name of the window index ([`additions`]).
pub fn window_index(table: &TableName) -> String {
    table.derived("idx_", "_pending_window")
}

/// The name of the key-order index (R33).
pub fn key_order_index(table: &TableName) -> String {
    table.derived("idx_", "_pending_key_order")
}

fn create_table(table: &TableName, if_not_exists: bool, layout: Layout) -> String {
    let t = table.table();
    // A partitioned table's unique constraints must hold the partition key (created_at).
    let (pkey, partition_by) = match layout {
        Layout::Plain => ("id", ""),
        Layout::Partitioned => ("id, created_at", " PARTITION BY RANGE (created_at)"),
    };
    format!(
        "CREATE TABLE {ine}{q} (
    id              uuid          NOT NULL,
    event_type      varchar(100)  NOT NULL,
    payload         jsonb         NOT NULL,
    headers         jsonb,
    trace_id        varchar(64),
    idempotency_key varchar(128),
    correlation_id  varchar(64),
    causation_id    varchar(64),
    schema_version  varchar(50),
    status          varchar(20)   NOT NULL,
    attempts_made   integer       NOT NULL,
    max_attempts    integer       NOT NULL,
    last_error      varchar(2000),
    scheduled_at    timestamptz   NOT NULL,
    completed_at    timestamptz,
    locked_at       timestamptz,
    locked_by       varchar(255),
    created_at      timestamptz   NOT NULL DEFAULT timezone('UTC', now()),
    updated_at      timestamptz            DEFAULT timezone('UTC', now()),
    aggregate_type  varchar(50)   NOT NULL,
    aggregate_id    uuid          NOT NULL,
    topic           varchar(255)  NOT NULL,
    partition_key   varchar(255)  NOT NULL,
    CONSTRAINT \"{t}_pkey\" PRIMARY KEY ({pkey}),
    CONSTRAINT \"ck_{t}_attempts_valid\"
        CHECK (attempts_made <= max_attempts),
    CONSTRAINT \"ck_{t}_completed_status_consistency\"
        CHECK ((status = 'completed' AND completed_at IS NOT NULL)
            OR (status <> 'completed' AND completed_at IS NULL)),
    CONSTRAINT \"ck_{t}_lock_consistency\"
        CHECK ((locked_at IS NULL AND locked_by IS NULL)
            OR (locked_at IS NOT NULL AND locked_by IS NOT NULL))
){partition_by}",
        ine = if if_not_exists { "IF NOT EXISTS " } else { "" },
        q = table.qualified(),
    )
}

fn create_index(
    table: &TableName,
    ix: &IndexDef,
    if_not_exists: bool,
    concurrently: bool,
) -> String {
    format!(
        "CREATE {u}INDEX {c}{ine}\"{n}\" ON {q} {b}",
        u = if ix.unique { "UNIQUE " } else { "" },
        c = if concurrently { "CONCURRENTLY " } else { "" },
        ine = if if_not_exists { "IF NOT EXISTS " } else { "" },
        n = ix.name,
        q = table.qualified(),
        b = ix.body
    )
}

/// The schema this library creates and uses, as statements to run in order in one
/// transaction: `CREATE SCHEMA IF NOT EXISTS` (when qualified), `CREATE TABLE IF NOT EXISTS`
/// with Appendix A's columns and constraints, and `CREATE [UNIQUE] INDEX IF NOT EXISTS` for its
/// seven indexes and the [`additions`]. Idempotent; on an existing ancestor table only missing
/// indexes are added (R79). Beyond Appendix A the library adds only the [`additions`] (PG-02).
///
/// For a large existing table, create the key-order index and the additions first, outside a
/// transaction, with [`create_indexes_concurrently`].
pub fn ddl(table: &TableName) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(s) = table.schema() {
        v.push(format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""));
    }
    v.push(create_table(table, true, Layout::Plain));
    for ix in indexes(table).into_iter().chain(additions(table)) {
        v.push(create_index(table, &ix, true, false));
    }
    v
}

/// `CREATE INDEX IF NOT EXISTS` for each of the [`additions`] (the same statements [`ddl`] and
/// [`partitioned::ddl`] end with), for a migration that adds them to a table created before
/// them.
pub fn create_additions(table: &TableName) -> Vec<String> {
    additions(table)
        .iter()
        .map(|ix| create_index(table, ix, true, false))
        .collect()
}

/// `CREATE INDEX CONCURRENTLY IF NOT EXISTS` for the key-order index and each of the
/// [`additions`] (R79): for a large existing table, run each alone, not in a transaction,
/// before [`ddl`], which then finds them. A concurrent build that failed leaves an invalid
/// index that `IF NOT EXISTS` keeps: drop it (`DROP INDEX CONCURRENTLY`) and run the statement
/// again.
pub fn create_indexes_concurrently(table: &TableName) -> Vec<String> {
    std::iter::once(create_key_order_index_concurrently(table))
        .chain(
            additions(table)
                .iter()
                .map(|ix| create_index(table, ix, true, true)),
        )
        .collect()
}

/// `CREATE INDEX CONCURRENTLY IF NOT EXISTS` for the key-order index (R79): run it alone, not in
/// a transaction, before [`ddl`] on a large existing table.
pub fn create_key_order_index_concurrently(table: &TableName) -> String {
    let ix = indexes(table)
        .into_iter()
        .find(|i| i.name == key_order_index(table))
        .expect("the key-order index is in the list");
    create_index(table, &ix, true, true)
}

/// The ancestor's DDL exactly as the ancestor library created it (R78) (no `IF NOT EXISTS`), with the
/// table name replaced. For tests (PG-02, PG-10) and for users who copy the SQL.
pub fn ancestor_ddl(table: &TableName) -> Vec<String> {
    let mut v = vec![create_table(table, false, Layout::Plain)];
    for ix in indexes(table) {
        v.push(create_index(table, &ix, false, false));
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Statements
// ---------------------------------------------------------------------------------------------

/// Every statement text for one table. Build once with [`Statements::new`]; the fields are
/// plain SQL with numbered parameters, documented one by one.
#[derive(Debug, Clone)]
pub struct Statements {
    /// The table.
    pub table: TableName,

    /// The table's layout ([`Statements::with_layout`]); [`Layout::Plain`] from
    /// [`Statements::new`].
    pub layout: Layout,

    /// Partitioned layout only (`None` for the plain one): the per-key advisory locks that
    /// serialize writers of one idempotency key (R17). `$1 text[]` the distinct keys of the
    /// write call, sorted ([`partitioned::lock_keys`]). Returns one row, one column
    /// `isolation text` (the transaction's isolation level, to check with
    /// `shared::check_write_isolation`). Run it in the caller's transaction before
    /// [`Statements::insert`], as its own statement; see [`partitioned`].
    pub idempotency_lock: Option<String>,

    /// `SELECT pg_advisory_xact_lock(hashtext($1))`; `$1 text` = [`Statements::schema_lock_key`].
    /// Take it in the schema-creation transaction so concurrent creators serialize.
    pub schema_lock: String,

    /// `SELECT now()`: the database clock (R72). One column `timestamptz`.
    pub now: String,

    /// `SELECT pg_notify($1, '')`; `$1 text` = [`TableName::notify_channel`]. Writers that
    /// notify run it in the caller's transaction after the insert, so PostgreSQL delivers the
    /// wake-up at commit and never for a rolled-back write.
    pub notify: String,

    /// One row by id. `$1 uuid`. Returns [`COLUMNS`] (0 or 1 row).
    pub get: String,

    /// Inserts many events in one statement, skipping rows whose id or idempotency key exists
    /// (`ON CONFLICT DO NOTHING`; a concurrent writer of the same key waits for the other
    /// transaction, R17). created_at = updated_at = one `clock_timestamp()` per statement
    /// (R73, R79); scheduled_at = the absolute time if given, else created_at + delay (R15).
    ///
    /// Parameters, all arrays of equal length (one element per event, in write order; build
    /// them with [`InsertColumns::new`]):
    /// `$1 uuid[]` id, `$2 text[]` event_type, `$3 text[]` payload (JSON text),
    /// `$4 text[]` headers (JSON text, NULL elements for none), `$5 text[]` trace_id,
    /// `$6 text[]` idempotency_key, `$7 text[]` correlation_id, `$8 text[]` causation_id,
    /// `$9 text[]` schema_version (these five with NULL elements), `$10 int4[]` max_attempts,
    /// `$11 timestamptz[]` absolute scheduled_at (NULL elements), `$12 int8[]` delay in
    /// microseconds (NULL elements), `$13 text[]` aggregate_type, `$14 uuid[]` aggregate_id,
    /// `$15 text[]` topic, `$16 text[]` partition_key.
    ///
    /// Returns [`COLUMNS`] of the rows inserted (in no particular order). Events that return no
    /// row already exist: read them with [`Statements::select_existing`]. Deduplicate repeats
    /// within one call first ([`dedupe_write`]).
    pub insert: String,

    /// The rows already stored for events that [`Statements::insert`] skipped.
    /// `$1 uuid[]` ids, `$2 text[]` idempotency keys (no NULLs). Returns [`COLUMNS`] of every
    /// row whose id is in `$1` or whose idempotency_key is in `$2`. Match each skipped event to
    /// the row with its idempotency key when it has one, else to the row with its id.
    pub select_existing: String,

    /// Fetch, first statement: choose the candidate heads (R20, R27–R29, R85). Text and
    /// parameters: `statements/fetch_heads.sql` (bind with [`FetchParams`] and a
    /// [`WalkCursor`]). Returns `(head_id uuid, topic text, partition_key text)` rows: heads in
    /// head order, then, when the key walk ran, one row with `head_id` NULL naming the walk's
    /// last key ([`HeadRows`] reads them). Run it in the fetch transaction, then
    /// [`Statements::fetch_take`] (lease delivery) or [`Statements::fetch_take_transaction`].
    ///
    /// How it stays flat: path A reads the `window` oldest fetchable rows, row-locking them
    /// with `SKIP LOCKED` as it reads them (concurrent relays read disjoint windows), reduces
    /// them to one per key and probes each for an earlier in-line row; path B, only when path A
    /// found fewer heads than the batch, walks keys from the cursor for at most `walk_limit`
    /// keys and stops after a batch of heads. No advisory lock is taken, and no work or lock
    /// grows with the number of keys, rows behind blocked heads, or completed rows (R85).
    pub fetch_heads: String,

    /// Fetch, second statement, lease delivery (R21, R76): lock the candidate heads in order
    /// until the batch is full, extend them into runs (R74), lock the run rows, stamp the
    /// lease. Text and parameters: `statements/fetch_take.sql` + `fetch_take_lease.sql`.
    /// Returns [`COLUMNS`] of the taken rows in return order (R22). Commit right after.
    pub fetch_take: String,

    /// Fetch, second statement, transaction delivery (R84): as [`Statements::fetch_take`]
    /// without the lease stamp (`fetch_take_transaction.sql`); the rows stay row-locked until
    /// the cycle's transaction ends.
    pub fetch_take_transaction: String,

    /// Completion write (R56) for many rows, guarded (R54). `$1 uuid[]` ids, `$2 text` worker.
    /// Returns `id uuid, status text, attempts_made int4, scheduled_at timestamptz` of the rows
    /// written; ids not returned lost their lease (R55).
    pub complete: String,

    /// Failure writes for many rows, guarded (R54): counted (R38), transient (R43, R44) and
    /// deferred (R47) in one statement. Parameters, arrays of equal length:
    /// `$1 uuid[]` ids, `$2 bool[]` counted (attempts_made + 1, `failed` at max_attempts),
    /// `$3 text[]` last_error (already normalized, R9), `$4 int8[]` retry after this many
    /// microseconds from `now()` (NULL elements), `$5 timestamptz[]` explicit retry time (NULL
    /// elements; wins over `$4`), then `$6 text` worker. Both NULL keeps scheduled_at (backoff
    /// base 0, deferral). Returns like [`Statements::complete`].
    pub fail: String,

    /// Delivery in one transaction (R84): [`Statements::complete`] guarded by the row lock the
    /// delivery holds instead of the lease holder (same parameters and result).
    pub complete_in_delivery: String,

    /// Delivery in one transaction (R84): [`Statements::fail`] guarded by the row lock the
    /// delivery holds (same parameters and result). Only counted failures are written there.
    pub fail_in_delivery: String,

    /// `SAVEPOINT outbox_window`: in a delivery transaction (R84), taken before
    /// [`Statements::fetch_heads`], so that [`Statements::window_release`] can drop the row
    /// locks of its window before [`Statements::fetch_take_transaction`]; the transaction then
    /// holds only the rows it took for the rest of the cycle.
    pub window_savepoint: String,

    /// `ROLLBACK TO SAVEPOINT outbox_window` (see [`Statements::window_savepoint`]).
    pub window_release: String,

    /// The first statement of a delivery transaction (R84, `statements/delivery_begin.sql`):
    /// `$1 text` the idle timeout in milliseconds after which the server ends the transaction.
    pub delivery_begin: String,

    /// Releases rows untouched (R77), guarded. `$1 uuid[]` ids, `$2 text` worker. Returns like
    /// [`Statements::complete`].
    pub release: String,

    /// refresh_lock (R24): `$1 uuid` id, `$2 text` worker. Affects 1 row when held by the
    /// worker, else 0.
    pub refresh_lock: String,

    /// release_lock (R24): `$1 uuid` id, `$2 text` worker. Affects 1 row when held, else 0.
    pub release_lock: String,

    /// Bulk release (R24): `$1 uuid[]` ids, `$2 text` worker. Affects the rows held by the
    /// worker; run it in a transaction and roll back when the count differs from the number of
    /// ids.
    pub release_locks: String,

    /// One batch of release_stale_locks (R63): `$1 int8` timeout in microseconds, `$2 int8`
    /// batch size. Releases up to `$2` pending rows with locked_at < now() − timeout, skipping
    /// row-locked rows. Affected-row count = rows released; repeat while it equals `$2`, at most
    /// 1000 times.
    pub release_stale: String,

    /// requeue_failed (R64): `$1 uuid`. Affects 1 row when the row was `failed`, else 0.
    pub requeue: String,

    /// One round of delete_old_completed (R65): `$1 int4` retention days, `$2 int8` batch size.
    /// Affected-row count = rows deleted.
    pub delete_old_completed: String,

    /// force_unlock (R66): `$1 uuid` id, `$2 text` last_error text (`Force unlock: …`). Affects
    /// 1 row when the row was held, else 0 (then report "not locked").
    pub force_unlock: String,

    /// Blocked keys (R80, R85): `statements/blocked_keys.sql`. Bind with
    /// [`BlockedKeysParams`]: `$1 int8` lease TTL in microseconds, `$2 int8` limit, `$3 int8`
    /// candidate bound, `$4 int8` waiting cap. Returns `topic text, partition_key text,
    /// head_id uuid, attempts_made int4, max_attempts int4, last_error text (nullable),
    /// next_try timestamptz, locked_by text (nullable), locked_at timestamptz (nullable),
    /// waiting int8`, oldest head first (write order); its work is bounded by `$2`–`$4`.
    pub blocked_keys: String,

    /// Counts (R80): no parameters. Returns `topic text, status text, count int8`, sorted by
    /// topic then status.
    pub counts: String,

    /// Oldest due age (R80, R85): `statements/oldest_due_age.sql`, no parameters. Returns one
    /// row, one column `age_us int8` (microseconds, NULL when no pending row is due); two
    /// one-row index reads.
    pub oldest_due_age: String,

    /// Test clock (the conformance harness's `advance`): `$1 int8` microseconds. Moves created_at,
    /// scheduled_at, locked_at, completed_at and updated_at of every row back by that much.
    #[cfg(feature = "testing")]
    pub shift_clock: String,
}

/// How many of the oldest fetchable rows path A of the fetch reads (`$6` of
/// [`Statements::fetch_heads`]): twice the batch, at least 64, at most 4000. With rows of many
/// keys interleaved, the first 2 × batch fetchable rows hold about 2 × batch × (1 − batch /
/// keys) heads, enough whenever there are at least twice as many keys as the batch; otherwise
/// the key walk tops the batch up.
pub fn fetch_window(batch: usize) -> i64 {
    (batch.saturating_mul(2)).clamp(64, 4000) as i64
}

/// How many keys the key walk of [`Statements::fetch_heads`] visits at most (`$7`): four times
/// the batch, at least 64, at most 10,000. The walk stops earlier, after a batch of heads; this
/// bound only matters when most keys it meets are blocked, and the cursor carries the walk on
/// at the next fetch (R20).
pub fn fetch_walk_limit(batch: usize) -> i64 {
    (batch.saturating_mul(4)).clamp(64, 10_000) as i64
}

/// Which second statement a fetch runs: [`Statements::fetch_take`] (lease delivery, R76) or
/// [`Statements::fetch_take_transaction`] (delivery in one transaction, R84, which also releases
/// the window's row locks before the take).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Stamp the lease.
    Lease,
    /// Keep the rows row-locked in the open delivery transaction.
    Transaction,
}

impl Statements {
    /// The text of the take statement for `take`.
    pub fn take(&self, take: Take) -> &str {
        match take {
            Take::Lease => &self.fetch_take,
            Take::Transaction => &self.fetch_take_transaction,
        }
    }
}

/// How many times a fetch runs its two statements when candidates were found but another relay
/// took every one of them between the two (each time with a new snapshot): an empty fetch
/// while due rows remain is what concurrent relays must avoid (R85), and the bound keeps the
/// fetch's work bounded by the batch.
pub const FETCH_ATTEMPTS: usize = 3;

/// The fetch parameters of a validated request, shared by both fetch statements.
#[derive(Debug, Clone, PartialEq)]
pub struct FetchParams {
    /// Batch size.
    pub limit: i64,
    /// Lease TTL in microseconds.
    pub lease_us: i64,
    /// max_per_key.
    pub max_per_key: i64,
    /// Topics filter.
    pub topics: Option<Vec<String>>,
    /// Aggregate types filter.
    pub aggregate_types: Option<Vec<String>>,
    /// Aggregate ids filter.
    pub aggregate_ids: Option<Vec<Uuid>>,
    /// Path A's window ([`fetch_window`]).
    pub window: i64,
    /// Path B's key bound ([`fetch_walk_limit`]).
    pub walk_limit: i64,
}

impl FetchParams {
    /// The parameters of a validated request.
    pub fn new(req: &FetchRequest) -> Self {
        Self {
            limit: req.limit.min(i64::MAX as usize) as i64,
            lease_us: micros(req.lease_ttl),
            max_per_key: req.max_per_key.min(i64::MAX as usize) as i64,
            topics: req.filter.topics.clone(),
            aggregate_types: req.filter.aggregate_types.clone(),
            aggregate_ids: req.filter.aggregate_ids.clone(),
            window: fetch_window(req.limit),
            walk_limit: fetch_walk_limit(req.limit),
        }
    }
}

/// Where the key walk of the next fetch starts (`$8`, `$9` of [`Statements::fetch_heads`]):
/// the last key the previous walk visited, so walk after walk goes round all keys (R20).
/// One per repository (clones share it); starts at the first key.
#[derive(Debug, Clone, Default)]
pub struct WalkCursor(std::sync::Arc<std::sync::Mutex<(String, String)>>);

impl WalkCursor {
    /// The (topic, partition_key) to bind; `("", "")` starts at the first key.
    pub fn get(&self) -> (String, String) {
        self.0.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Moves the cursor to the walk's last key, when the fetch walked.
    pub fn advance(&self, to: Option<(String, String)>) {
        if let (Some(to), Ok(mut c)) = (to, self.0.lock()) {
            *c = to;
        }
    }
}

/// The rows of [`Statements::fetch_heads`], read: the candidate heads in head order, to bind as
/// `$8` of [`Statements::fetch_take`], and the walk's last key, for [`WalkCursor::advance`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadRows {
    /// Candidate head ids in head order.
    pub ids: Vec<Uuid>,
    /// The last key the walk visited (None when path A alone answered).
    pub walked_to: Option<(String, String)>,
}

impl HeadRows {
    /// Reads `(head_id, topic, partition_key)` rows in the statement's order.
    pub fn new(rows: impl IntoIterator<Item = (Option<Uuid>, String, String)>) -> Self {
        let mut out = HeadRows::default();
        for (id, topic, key) in rows {
            match id {
                Some(id) => out.ids.push(id),
                None => out.walked_to = Some((topic, key)),
            }
        }
        out
    }
}

/// The parameters of [`Statements::blocked_keys`] in bind order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockedKeysParams {
    /// `$1` lease TTL in microseconds.
    pub lease_us: i64,
    /// `$2` limit.
    pub limit: i64,
    /// `$3` rows read from each candidate source: 4 × limit + 64, at most 100,000.
    pub candidates: i64,
    /// `$4` the waiting count stops here ([`outbox_core::repository::BLOCKED_WAITING_CAP`]).
    pub waiting_cap: i64,
}

impl BlockedKeysParams {
    /// The parameters for a lease TTL and a limit.
    pub fn new(lease_ttl: Duration, limit: usize) -> Self {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Self {
            lease_us: micros(lease_ttl),
            limit,
            candidates: limit.saturating_mul(4).saturating_add(64).min(100_000),
            waiting_cap: outbox_core::repository::BLOCKED_WAITING_CAP,
        }
    }
}

/// The statement texts, one `.sql` file each under `src/sql/statements/`, with their
/// parameters and result columns documented in the file. Rendered by [`render`].
mod text {
    pub const FETCH_HEADS: &str = include_str!("sql/statements/fetch_heads.sql");
    pub const FETCH_TAKE: &str = include_str!("sql/statements/fetch_take.sql");
    pub const FETCH_TAKE_LEASE: &str = include_str!("sql/statements/fetch_take_lease.sql");
    pub const FETCH_TAKE_TRANSACTION: &str =
        include_str!("sql/statements/fetch_take_transaction.sql");
    pub const GET: &str = include_str!("sql/statements/get.sql");
    pub const COMPLETE: &str = include_str!("sql/statements/complete.sql");
    pub const FAIL: &str = include_str!("sql/statements/fail.sql");
    pub const RELEASE: &str = include_str!("sql/statements/release.sql");
    pub const REFRESH_LOCK: &str = include_str!("sql/statements/refresh_lock.sql");
    pub const RELEASE_LOCK: &str = include_str!("sql/statements/release_lock.sql");
    pub const RELEASE_LOCKS: &str = include_str!("sql/statements/release_locks.sql");
    pub const RELEASE_STALE: &str = include_str!("sql/statements/release_stale.sql");
    pub const REQUEUE: &str = include_str!("sql/statements/requeue.sql");
    pub const DELETE_OLD_COMPLETED: &str = include_str!("sql/statements/delete_old_completed.sql");
    pub const FORCE_UNLOCK: &str = include_str!("sql/statements/force_unlock.sql");
    pub const BLOCKED_KEYS: &str = include_str!("sql/statements/blocked_keys.sql");
    pub const COUNTS: &str = include_str!("sql/statements/counts.sql");
    pub const OLDEST_DUE_AGE: &str = include_str!("sql/statements/oldest_due_age.sql");
    #[cfg(feature = "testing")]
    pub const SHIFT_CLOCK: &str = include_str!("sql/statements/shift_clock.sql");
    pub const DELIVERY_BEGIN: &str = include_str!("sql/statements/delivery_begin.sql");
}

/// A statement file made ready to send: comment lines (`--`) dropped, each `(name, text)` of
/// `parts` substituted for `{name}` and each fragment `{name:alias}` expanded (see
/// `fragments`), then `{table}` replaced by the quoted, validated table name and `{columns}` /
/// `{t_columns}` by [`COLUMNS`] (bare / with alias `t`).
fn render(src: &str, table: &TableName, parts: &[(&str, &str)]) -> String {
    fragments::expand(&fragments::strip(src), parts)
        .replace("{table}", &table.qualified())
        .replace("{t_columns}", &column_list("t"))
        .replace("{columns}", &column_list(""))
        .trim()
        .to_owned()
}

/// The bind parameters of [`Statements::fetch_heads`] that its fragments name.
const HEADS_BINDS: [(&str, &str); 4] = [
    ("lease_us", "$2::int8"),
    ("topics", "$3::text[]"),
    ("aggregate_types", "$4::text[]"),
    ("aggregate_ids", "$5::uuid[]"),
];

/// The parts of [`Statements::fetch_take`]: the bind parameters its fragments name and its
/// `finish` (lease stamp or transaction delivery).
fn take_parts(finish: &str) -> [(&str, &str); 5] {
    [
        ("finish", finish),
        ("lease_us", "$3::int8"),
        ("topics", "$5::text[]"),
        ("aggregate_types", "$6::text[]"),
        ("aggregate_ids", "$7::uuid[]"),
    ]
}

/// A duration as whole microseconds, saturating at `i64::MAX`.
pub fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

impl Statements {
    /// All statement texts for `table`.
    pub fn new(table: &TableName) -> Self {
        let t = table.qualified();
        let cols = column_list("");
        let r = |src: &str| render(src, table, &[]);
        Statements {
            table: table.clone(),
            layout: Layout::Plain,
            idempotency_lock: None,
            schema_lock: "SELECT pg_advisory_xact_lock(hashtext($1::text))".into(),
            now: "SELECT now()".into(),
            notify: "SELECT pg_notify($1::text, '')".into(),
            get: r(text::GET),
            insert: insert_statement(&t, &cols, ""),
            select_existing: format!(
                "SELECT {cols} FROM {t} WHERE id = ANY($1::uuid[]) OR idempotency_key = ANY($2::text[])"
            ),
            fetch_heads: render(text::FETCH_HEADS, table, &HEADS_BINDS),
            fetch_take: render(text::FETCH_TAKE, table, &take_parts(text::FETCH_TAKE_LEASE)),
            fetch_take_transaction: render(
                text::FETCH_TAKE,
                table,
                &take_parts(text::FETCH_TAKE_TRANSACTION),
            ),
            complete: render(
                text::COMPLETE,
                table,
                &[("holder", "t.locked_by = $2::text")],
            ),
            fail: render(text::FAIL, table, &[("holder", "t.locked_by = $6::text")]),
            complete_in_delivery: render(
                text::COMPLETE,
                table,
                &[("holder", "$2::text IS NOT NULL")],
            ),
            fail_in_delivery: render(text::FAIL, table, &[("holder", "$6::text IS NOT NULL")]),
            delivery_begin: r(text::DELIVERY_BEGIN),
            window_savepoint: "SAVEPOINT outbox_window".into(),
            window_release: "ROLLBACK TO SAVEPOINT outbox_window".into(),
            release: r(text::RELEASE),
            refresh_lock: r(text::REFRESH_LOCK),
            release_lock: r(text::RELEASE_LOCK),
            release_locks: r(text::RELEASE_LOCKS),
            release_stale: r(text::RELEASE_STALE),
            requeue: r(text::REQUEUE),
            delete_old_completed: r(text::DELETE_OLD_COMPLETED),
            force_unlock: r(text::FORCE_UNLOCK),
            blocked_keys: r(text::BLOCKED_KEYS),
            counts: r(text::COUNTS),
            oldest_due_age: r(text::OLDEST_DUE_AGE),
            #[cfg(feature = "testing")]
            shift_clock: r(text::SHIFT_CLOCK),
        }
    }

    /// The key for [`Statements::schema_lock`]: `outbox-schema:` + the dotted table name.
    pub fn schema_lock_key(&self) -> String {
        format!("outbox-schema:{}", self.table.dotted())
    }
}

/// Marks the error the insert raises for an absolute schedule outside the insert window; see
/// [`schedule_refusal`].
pub const SCHEDULE_REFUSED: &str = "outbox-schedule-refused";

/// The insert of [`Statements::insert`] for the quoted table `t` and column list `cols`;
/// `guard` (empty, or `WHERE …` over the unnested row `u`) decides which rows are inserted.
///
/// An absolute scheduled_at is checked against created_at, the database clock at insert: outside
/// [created_at − 60 s, created_at + 365 days] (R8, D2; the ancestor's load check) the statement
/// fails before it inserts anything, by casting a marked text to timestamptz (plain SQL has no
/// RAISE); [`schedule_refusal`] turns that error into
/// [`ValidationError::ScheduleOutsideInsertWindow`].
fn insert_statement(t: &str, cols: &str, guard: &str) -> String {
    let skew = outbox_core::event::limits::DEFAULT_SCHEDULE_SKEW_SECS;
    let ahead = outbox_core::event::limits::SCHEDULE_MAX_AHEAD_SECS;
    format!(
        "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS ts)
INSERT INTO {t} ({cols})
SELECT u.id, u.event_type, u.payload::jsonb, u.headers::jsonb, u.trace_id, u.idempotency_key,
       u.correlation_id, u.causation_id, u.schema_version, 'pending', 0, u.max_attempts, NULL,
       CASE WHEN u.scheduled_at IS NULL
                 THEN c.ts + COALESCE(u.delay_us, 0) * INTERVAL '1 microsecond'
            WHEN u.scheduled_at >= c.ts - INTERVAL '{skew} seconds'
             AND u.scheduled_at <= c.ts + INTERVAL '{ahead} seconds'
                 THEN u.scheduled_at
            ELSE ('{SCHEDULE_REFUSED} ' || u.id::text
                  || ' ' || (EXTRACT(EPOCH FROM u.scheduled_at) * 1000000)::int8::text
                  || ' ' || (EXTRACT(EPOCH FROM c.ts) * 1000000)::int8::text)::timestamptz
       END,
       NULL, NULL, NULL, c.ts, c.ts, u.aggregate_type, u.aggregate_id, u.topic, u.partition_key
  FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
              $8::text[], $9::text[], $10::int4[], $11::timestamptz[], $12::int8[], $13::text[],
              $14::uuid[], $15::text[], $16::text[])
       WITH ORDINALITY AS u(id, event_type, payload, headers, trace_id, idempotency_key,
                            correlation_id, causation_id, schema_version, max_attempts,
                            scheduled_at, delay_us, aggregate_type, aggregate_id, topic,
                            partition_key, ord)
 CROSS JOIN c{guard}
 ORDER BY u.ord
ON CONFLICT DO NOTHING
RETURNING {cols}"
    )
}

/// The refusal of an absolute schedule by the insert ([`SCHEDULE_REFUSED`]), read back from a
/// database error message; `None` for any other error. Both Postgres backends map their insert
/// errors through this first.
pub fn schedule_refusal(message: &str) -> Option<outbox_core::ValidationError> {
    let rest = &message[message.find(SCHEDULE_REFUSED)? + SCHEDULE_REFUSED.len()..];
    let mut parts = rest
        .split(|c: char| c.is_whitespace() || c == '"')
        .filter(|p| !p.is_empty());
    let id = parts.next()?.parse::<Uuid>().ok()?;
    let mut micros = || {
        parts
            .next()?
            .parse::<i64>()
            .ok()
            .and_then(DateTime::<Utc>::from_timestamp_micros)
    };
    let at = micros()?;
    let created_at = micros()?;
    Some(outbox_core::ValidationError::ScheduleOutsideInsertWindow { id, at, created_at })
}

#[cfg(test)]
mod schedule_refusal_tests {
    use super::*;

    #[test]
    fn the_insert_refusal_is_read_back_and_other_errors_are_not() {
        let id = Uuid::now_v7();
        let msg = format!(
            "invalid input syntax for type timestamp with time zone: \"{SCHEDULE_REFUSED} {id} 1700000000000000 1700000090000001\""
        );
        let at = DateTime::<Utc>::from_timestamp_micros(1_700_000_000_000_000).unwrap();
        let created_at = DateTime::<Utc>::from_timestamp_micros(1_700_000_090_000_001).unwrap();
        assert_eq!(
            schedule_refusal(&msg),
            Some(outbox_core::ValidationError::ScheduleOutsideInsertWindow { id, at, created_at })
        );
        assert_eq!(
            schedule_refusal("invalid input syntax for type timestamp"),
            None
        );
        assert_eq!(
            schedule_refusal(&format!("{SCHEDULE_REFUSED} not-a-uuid 1 2")),
            None
        );
    }

    #[test]
    fn both_layouts_check_an_absolute_schedule_at_insert() {
        let t = TableName::new("outbox_events").unwrap();
        for layout in [Layout::Plain, Layout::Partitioned] {
            let s = Statements::with_layout(&t, layout).insert;
            assert!(s.contains(SCHEDULE_REFUSED), "{layout:?}");
            assert!(s.contains("c.ts - INTERVAL '60 seconds'"), "{layout:?}");
            assert!(
                s.contains("c.ts + INTERVAL '31536000 seconds'"),
                "{layout:?}"
            );
        }
    }
}

impl Statements {
    /// All statement texts for `table` with `layout`: for [`Layout::Partitioned`], the plain
    /// statements with [`Statements::idempotency_lock`] set and [`Statements::insert`] /
    /// [`Statements::select_existing`] replaced by [`partitioned::insert`] /
    /// [`partitioned::select_existing`]; every other statement is the same text.
    pub fn with_layout(table: &TableName, layout: Layout) -> Self {
        let mut s = Self::new(table);
        if layout == Layout::Partitioned {
            s.layout = layout;
            s.idempotency_lock = Some(partitioned::idempotency_lock(table));
            s.insert = partitioned::insert(table);
            s.select_existing = partitioned::select_existing(table);
        }
        s
    }
}

// ---------------------------------------------------------------------------------------------
// Writing: parameters and repeats within one call
// ---------------------------------------------------------------------------------------------

/// The sixteen array parameters of [`Statements::insert`], in bind order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InsertColumns {
    /// `$1`.
    pub id: Vec<Uuid>,
    /// `$2`.
    pub event_type: Vec<String>,
    /// `$3` payload as compact JSON.
    pub payload: Vec<String>,
    /// `$4` headers as JSON, or NULL.
    pub headers: Vec<Option<String>>,
    /// `$5`.
    pub trace_id: Vec<Option<String>>,
    /// `$6`.
    pub idempotency_key: Vec<Option<String>>,
    /// `$7`.
    pub correlation_id: Vec<Option<String>>,
    /// `$8`.
    pub causation_id: Vec<Option<String>>,
    /// `$9`.
    pub schema_version: Vec<Option<String>>,
    /// `$10`.
    pub max_attempts: Vec<i32>,
    /// `$11` absolute scheduled_at.
    pub scheduled_at: Vec<Option<DateTime<Utc>>>,
    /// `$12` delay in microseconds.
    pub delay_us: Vec<Option<i64>>,
    /// `$13`.
    pub aggregate_type: Vec<String>,
    /// `$14`.
    pub aggregate_id: Vec<Uuid>,
    /// `$15`.
    pub topic: Vec<String>,
    /// `$16`.
    pub partition_key: Vec<String>,
}

impl InsertColumns {
    /// The columns of these events, in order.
    pub fn new<'a>(events: impl IntoIterator<Item = &'a NewEvent>) -> Self {
        let mut c = Self::default();
        for e in events {
            c.id.push(e.id());
            c.event_type.push(e.event_type().to_owned());
            c.payload.push(e.payload_json().to_owned());
            c.headers.push(e.headers_json().map(|h| h.to_string()));
            c.trace_id.push(e.trace_id().map(str::to_owned));
            c.idempotency_key
                .push(e.idempotency_key().map(str::to_owned));
            c.correlation_id.push(e.correlation_id().map(str::to_owned));
            c.causation_id.push(e.causation_id().map(str::to_owned));
            c.schema_version.push(e.schema_version().map(str::to_owned));
            c.max_attempts.push(e.max_attempts());
            c.scheduled_at.push(e.scheduled_at());
            c.delay_us.push(e.delay().map(micros));
            c.aggregate_type.push(e.aggregate_type().to_owned());
            c.aggregate_id.push(e.aggregate_id());
            c.topic.push(e.topic().to_owned());
            c.partition_key.push(e.partition_key().to_owned());
        }
        c
    }
}

/// How one write call handles repeats (R16): `first[i]` is the index of the first event in the
/// call with event i's idempotency key (or, without a key, its id); `unique` lists the indexes
/// to insert, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// For each event, the index of the event whose result it shares.
    pub first: Vec<usize>,
    /// The events to send to [`Statements::insert`], in call order.
    pub unique: Vec<usize>,
}

/// Collapses repeats within one write call: a repeated idempotency key, or a repeated id, goes
/// to its first occurrence (R16; I-04).
pub fn dedupe_write(events: &[NewEvent]) -> WritePlan {
    let mut by_key: BTreeMap<&str, usize> = BTreeMap::new();
    let mut by_id: BTreeMap<Uuid, usize> = BTreeMap::new();
    let mut first = Vec::with_capacity(events.len());
    let mut unique = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let prior = e
            .idempotency_key()
            .and_then(|k| by_key.get(k).copied())
            .or_else(|| by_id.get(&e.id()).copied());
        match prior {
            Some(p) => first.push(p),
            None => {
                if let Some(k) = e.idempotency_key() {
                    by_key.insert(k, i);
                }
                by_id.insert(e.id(), i);
                first.push(i);
                unique.push(i);
            }
        }
    }
    WritePlan { first, unique }
}

// ---------------------------------------------------------------------------------------------
// Reading: row mapping
// ---------------------------------------------------------------------------------------------

/// One row as the driver decodes [`COLUMNS`], before the outbox's own decoding. The Rust type
/// of each field is what a driver should decode the column into.
#[derive(Debug, Clone, PartialEq)]
pub struct RawRow {
    /// `id uuid`.
    pub id: Uuid,
    /// `event_type varchar`.
    pub event_type: String,
    /// `payload jsonb`.
    pub payload: serde_json::Value,
    /// `headers jsonb` (NULL → None). Must be an object of strings to decode (R82).
    pub headers: Option<serde_json::Value>,
    /// `trace_id varchar`.
    pub trace_id: Option<String>,
    /// `idempotency_key varchar`.
    pub idempotency_key: Option<String>,
    /// `correlation_id varchar`.
    pub correlation_id: Option<String>,
    /// `causation_id varchar`.
    pub causation_id: Option<String>,
    /// `schema_version varchar`.
    pub schema_version: Option<String>,
    /// `status varchar`: `pending`, `completed` or `failed` to decode.
    pub status: String,
    /// `attempts_made integer`.
    pub attempts_made: i32,
    /// `max_attempts integer`.
    pub max_attempts: i32,
    /// `last_error varchar`.
    pub last_error: Option<String>,
    /// `scheduled_at timestamptz`.
    pub scheduled_at: DateTime<Utc>,
    /// `completed_at timestamptz`.
    pub completed_at: Option<DateTime<Utc>>,
    /// `locked_at timestamptz`.
    pub locked_at: Option<DateTime<Utc>>,
    /// `locked_by varchar`.
    pub locked_by: Option<String>,
    /// `created_at timestamptz`.
    pub created_at: DateTime<Utc>,
    /// `updated_at timestamptz` (nullable in the ancestor's DDL).
    pub updated_at: Option<DateTime<Utc>>,
    /// `aggregate_type varchar`.
    pub aggregate_type: String,
    /// `aggregate_id uuid`.
    pub aggregate_id: Uuid,
    /// `topic varchar`.
    pub topic: String,
    /// `partition_key varchar`.
    pub partition_key: String,
}

/// Headers as stored (jsonb or NULL) to the event's map: NULL, JSON null and `{}` are none; an
/// object whose values are all strings is the map; anything else cannot be decoded (R82).
pub fn decode_headers(
    v: Option<serde_json::Value>,
) -> Result<Option<BTreeMap<String, String>>, String> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Object(m)) => {
            if m.is_empty() {
                return Ok(None);
            }
            let mut out = BTreeMap::new();
            for (k, v) in m {
                match v {
                    serde_json::Value::String(s) => {
                        out.insert(k, s);
                    }
                    other => {
                        return Err(format!(
                            "headers must map strings to strings, but {k:?} holds {other}"
                        ));
                    }
                }
            }
            Ok(Some(out))
        }
        Some(other) => Err(format!("headers must be a JSON object, got {other}")),
    }
}

/// A PostgreSQL timestamp (microseconds since 2000-01-01 00:00 UTC, as the binary protocol
/// sends it) as a chrono time, or `None` for `±infinity` and values outside chrono's range
/// (R82: the row is then undecodable; nothing panics).
pub fn timestamp_from_pg_micros(micros: i64) -> Option<DateTime<Utc>> {
    let epoch = DateTime::<Utc>::from_timestamp(946_684_800, 0)?;
    if micros == i64::MAX || micros == i64::MIN {
        return None;
    }
    epoch.checked_add_signed(chrono::Duration::microseconds(micros))
}

impl RawRow {
    /// Decodes the row, or says why it cannot be (R82). The error is the text after
    /// `undecodable row: ` (the relay adds the prefix).
    pub fn decode(mut self) -> Result<OutboxEvent, UndecodableRow> {
        let status = self.status.parse::<Status>();
        let headers = decode_headers(self.headers.take());
        let reason = match (&status, &headers) {
            (Err(e), _) => Some(e.clone()),
            (_, Err(e)) => Some(e.clone()),
            _ => None,
        };
        if let Some(reason) = reason {
            return Err(UndecodableRow {
                id: self.id,
                topic: self.topic,
                partition_key: self.partition_key,
                attempts_made: self.attempts_made,
                reason,
            });
        }
        Ok(OutboxEvent {
            id: self.id,
            event_type: self.event_type,
            payload: self.payload,
            headers: headers.expect("checked"),
            trace_id: self.trace_id,
            idempotency_key: self.idempotency_key,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            schema_version: self.schema_version,
            status: status.expect("checked"),
            attempts_made: self.attempts_made,
            max_attempts: self.max_attempts,
            last_error: self.last_error,
            scheduled_at: self.scheduled_at,
            completed_at: self.completed_at,
            locked_at: self.locked_at,
            locked_by: self.locked_by,
            created_at: self.created_at,
            updated_at: self.updated_at,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            topic: self.topic,
            partition_key: self.partition_key,
        })
    }
}

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

// ---------------------------------------------------------------------------------------------
// Test fixtures shared by the Postgres harnesses
// ---------------------------------------------------------------------------------------------

/// SQL for the conformance harnesses of both Postgres backends (not used by the library).
pub mod fixtures {
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
        format!(
            "INSERT INTO \"{schema}\".aggregates (name) VALUES ($1::text) ON CONFLICT DO NOTHING"
        )
    }

    /// `DROP SCHEMA IF EXISTS "<schema>" CASCADE`.
    pub fn drop_schema(schema: &str) -> String {
        format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rendered statement is complete: no `{placeholder}` left, no comment line, the
    /// table quoted, and every `$n` it uses numbered from 1 without a gap.
    #[test]
    fn statement_files_render_completely() {
        let t = TableName::new("ops.outbox_events").unwrap();
        let s = Statements::new(&t);
        #[allow(unused_mut)]
        let mut all = vec![
            ("fetch_heads", &s.fetch_heads),
            ("fetch_take", &s.fetch_take),
            ("fetch_take_transaction", &s.fetch_take_transaction),
            ("get", &s.get),
            ("complete", &s.complete),
            ("fail", &s.fail),
            ("complete_in_delivery", &s.complete_in_delivery),
            ("fail_in_delivery", &s.fail_in_delivery),
            ("release", &s.release),
            ("refresh_lock", &s.refresh_lock),
            ("release_lock", &s.release_lock),
            ("release_locks", &s.release_locks),
            ("release_stale", &s.release_stale),
            ("requeue", &s.requeue),
            ("delete_old_completed", &s.delete_old_completed),
            ("force_unlock", &s.force_unlock),
            ("blocked_keys", &s.blocked_keys),
            ("counts", &s.counts),
            ("oldest_due_age", &s.oldest_due_age),
        ];
        #[cfg(feature = "testing")]
        all.push(("shift_clock", &s.shift_clock));
        for &(name, text) in &all {
            assert!(!text.contains('{') && !text.contains('}'), "{name}: {text}");
            assert!(!text.contains("--"), "{name} keeps a comment");
            assert!(text.contains("\"ops\".\"outbox_events\""), "{name}: {text}");
            let mut used: Vec<u32> = text
                .split('$')
                .skip(1)
                .filter_map(|p| {
                    let d: String = p.chars().take_while(char::is_ascii_digit).collect();
                    d.parse().ok()
                })
                .collect();
            used.sort_unstable();
            used.dedup();
            assert!(
                used.iter().enumerate().all(|(i, n)| *n == i as u32 + 1),
                "{name} parameters {used:?}"
            );
        }
        let want: Vec<(&str, usize)> = vec![
            ("fetch_heads", 9),
            ("fetch_take", 8),
            ("fetch_take_transaction", 8),
            ("blocked_keys", 4),
        ];
        for (name, n) in want {
            let text = all.iter().find(|(k, _)| *k == name).unwrap().1;
            assert!(text.contains(&format!("${n}")) && !text.contains(&format!("${}", n + 1)));
        }
    }

    #[test]
    fn table_names_follow_r78() {
        assert!(TableName::new("outbox_events").is_ok());
        assert!(TableName::new("ops.outbox_events").is_ok());
        assert!(TableName::new("Outbox").is_err());
        assert!(TableName::new("a-b").is_err());
        assert!(TableName::new(&"a".repeat(31)).is_ok());
        assert!(TableName::new(&"a".repeat(32)).is_err());
        assert!(TableName::new(&format!("{}.t", "s".repeat(63))).is_ok());
        assert!(TableName::new(&format!("{}.t", "s".repeat(64))).is_err());
        assert!(TableName::new("a.b.c").is_err());
        assert!(TableName::new("").is_err());
        assert!(TableName::new("1abc").is_err());
        assert!(TableName::new("x\"; drop table y; --").is_err());
        let t = TableName::new(&"a".repeat(31)).unwrap();
        for ix in indexes(&t) {
            assert!(ix.name.len() <= 63, "{}", ix.name);
        }
        assert!(format!("ck_{}_completed_status_consistency", t.table()).len() <= 63);
    }

    #[test]
    fn notify_channels_fit_postgres_limit_and_differ_per_table() {
        let short = TableName::new("s1.outbox_events").unwrap();
        assert_eq!(short.notify_channel(), "outbox.s1.outbox_events");
        let long = TableName::new(&format!("{}.{}", "s".repeat(63), "t".repeat(31))).unwrap();
        let c = long.notify_channel();
        assert!(c.len() <= 63, "{c}");
        assert_eq!(c, long.notify_channel());
        let other = TableName::new(&format!("{}.{}", "s".repeat(63), "u".repeat(31))).unwrap();
        assert_ne!(c, other.notify_channel());
    }

    #[test]
    fn ddl_names_derive_from_the_table() {
        let t = TableName::new("ops.my_outbox").unwrap();
        let ddl = ddl(&t).join(";\n");
        assert!(ddl.contains("CREATE SCHEMA IF NOT EXISTS \"ops\""));
        assert!(ddl.contains("\"ck_my_outbox_lock_consistency\""));
        assert!(ddl.contains("\"idx_my_outbox_pending_key_order\" ON \"ops\".\"my_outbox\""));
        assert!(!ddl.contains("outbox_events"));
        assert_eq!(ancestor_ddl(&t).len(), 8);
    }

    #[test]
    fn headers_decode_only_as_string_maps() {
        assert_eq!(decode_headers(None), Ok(None));
        assert_eq!(decode_headers(Some(serde_json::json!({}))), Ok(None));
        assert_eq!(
            decode_headers(Some(serde_json::json!({"a": "b"})))
                .unwrap()
                .unwrap()["a"],
            "b"
        );
        assert!(decode_headers(Some(serde_json::json!({"a": 1}))).is_err());
        assert!(decode_headers(Some(serde_json::json!(["a"]))).is_err());
    }

    #[test]
    fn sqlstates_classify() {
        assert_eq!(classify("08006"), ErrorClass::Transient);
        assert_eq!(classify("57P01"), ErrorClass::Transient);
        assert_eq!(classify("23505"), ErrorClass::Constraint);
        assert_eq!(classify("42P01"), ErrorClass::Schema);
        assert_eq!(classify("22001"), ErrorClass::Other);
    }
}
