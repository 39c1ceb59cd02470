//! The inbox's SQL (contract Part II, Appendix D): the DDL of the plain and the partitioned
//! inbox table and the statement texts of the inbox store, rendered for a validated table name.
//!
//! Each statement is a file under `src/sql/inbox/` with its parameters and result columns
//! documented at its top; the outbox statements whose rule is the same on the inbox table
//! (`get`, `requeue`, `release_locks`, `release_stale`, `force_unlock`, `delete_old_completed`,
//! the test clock) are the outbox's own files, rendered for the inbox table. Predicates come
//! from the shared fragments (`in_line`, `key_order`, `pending`): no rule is typed twice.
//! Every value is a bound parameter; the table name is a validated [`TableName`].

use crate::sql::partitioned::Layout;
use crate::sql::{TableName, fragments};

/// The default plain inbox table (the ancestor's).
pub const DEFAULT_INBOX_TABLE: &str = "inbox_events";
/// The default partitioned inbox table (the ancestor's).
pub const DEFAULT_PARTITIONED_INBOX_TABLE: &str = "inbox_events_partitioned";

/// The inbox columns in DDL order (the ancestor's 22, then `partition_key`); every
/// row-returning statement returns these.
pub const INBOX_COLUMNS: [&str; 23] = [
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
    "message_id",
    "consumer_group",
    "source",
    "partition_key",
];

/// [`INBOX_COLUMNS`] joined with `, `, each prefixed by `alias.` when `alias` is not empty.
pub fn inbox_column_list(alias: &str) -> String {
    INBOX_COLUMNS
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

/// The name prefix of constraints and indexes (R173): `inbox_events_p` for the default
/// partitioned table, else the table name.
pub fn prefix(table: &TableName) -> String {
    if table.table() == DEFAULT_PARTITIONED_INBOX_TABLE {
        "inbox_events_p".to_owned()
    } else {
        table.table().to_owned()
    }
}

/// The dedup index's name (R108, R173): `idx_inbox_deduplication` for the default plain table,
/// else `idx_{p}_deduplication`.
pub fn dedup_index(table: &TableName, layout: Layout) -> String {
    if layout == Layout::Plain && table.table() == DEFAULT_INBOX_TABLE {
        "idx_inbox_deduplication".to_owned()
    } else {
        format!("idx_{}_deduplication", prefix(table))
    }
}

/// One index of the inbox schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxIndex {
    /// Its name (R173).
    pub name: String,
    /// Whether unique.
    pub unique: bool,
    /// Columns and predicate, the part after `ON <table>`.
    pub body: String,
}

/// The ancestor's indexes of Appendix D for `layout`, in its order.
pub fn ancestor_indexes(table: &TableName, layout: Layout) -> Vec<InboxIndex> {
    let p = prefix(table);
    let i = |suffix: &str, unique: bool, body: &str| InboxIndex {
        name: format!("idx_{p}{suffix}"),
        unique,
        body: body.to_owned(),
    };
    let dedup = |body: &str| InboxIndex {
        name: dedup_index(table, layout),
        unique: true,
        body: body.to_owned(),
    };
    let cleanup = i(
        "_completed_cleanup",
        false,
        "(completed_at) WHERE status = 'completed' AND completed_at IS NOT NULL",
    );
    let created = i("_created_at", false, "(created_at)");
    let locked = i(
        "_locked_at",
        false,
        "(locked_at) WHERE locked_at IS NOT NULL",
    );
    let fetch = i(
        "_pending_fetch",
        false,
        "(scheduled_at) WHERE status = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts",
    );
    let updated = i("_updated_at", false, "(updated_at)");
    match layout {
        Layout::Plain => vec![
            dedup("(message_id, consumer_group)"),
            cleanup,
            created,
            i(
                "_idempotency_key",
                true,
                "(idempotency_key) WHERE idempotency_key IS NOT NULL",
            ),
            locked,
            fetch,
            updated,
        ],
        Layout::Partitioned => vec![
            dedup("(message_id, consumer_group, created_at)"),
            i("_message_consumer", false, "(message_id, consumer_group)"),
            i(
                "_idempotency_key",
                true,
                "(idempotency_key, created_at) WHERE idempotency_key IS NOT NULL",
            ),
            cleanup,
            created,
            locked,
            fetch,
            updated,
        ],
    }
}

/// The indexes the library adds to both tables, in creation order: Appendix D's two, the key
/// order's and the group's, then the fetch window's ([`window_index`]), then the parked rows'
/// (`idx_<p>_parked`, R193: the blocked keys, gauges, redrive and discard read parked rows from it).
pub fn addition_indexes(table: &TableName) -> Vec<InboxIndex> {
    let p = prefix(table);
    vec![
        InboxIndex {
            name: format!("idx_{p}_pending_key_order"),
            unique: false,
            body: "(consumer_group, source, partition_key, created_at) WHERE status = 'pending' AND partition_key IS NOT NULL".into(),
        },
        InboxIndex {
            name: format!("idx_{p}_pending_group"),
            unique: false,
            body: "(consumer_group, scheduled_at) WHERE status = 'pending'".into(),
        },
        InboxIndex {
            name: window_index(table),
            unique: false,
            body: format!(
                "(consumer_group, scheduled_at, created_at, id) WHERE {}",
                fragments::fragment("window", "")
            ),
        },
        InboxIndex {
            name: format!("idx_{p}_parked"),
            unique: false,
            body: crate::sql::PARKED_INDEX_BODY.into(),
        },
    ]
}

/// The name of the fetch window's index (R173's prefix): `idx_<p>_pending_window` on
/// `(consumer_group, scheduled_at, created_at, id)` over the unlocked pending rows with attempts
/// left, the outbox's `window` predicate (written under the "C" collation). Its order is the
/// window's `ORDER BY` within a group, and its predicate is implied by the window's and by no
/// other statement's, so a fetch reads its window in this index's order and stops at the
/// window's size whatever the planner's statistics (a fresh table never analysed, statistics
/// from a quiet table, fresh ones); without it the planner read the group's whole backlog from
/// `idx_<p>_pending_group` and sorted it. Maintained by PostgreSQL like any index: rows that
/// omni-box 0.3.1 or plain SQL writes are indexed like ours, and omni-box does not use it.
pub fn window_index(table: &TableName) -> String {
    format!("idx_{}_pending_window", prefix(table))
}

fn create_table(table: &TableName, layout: Layout, if_not_exists: bool) -> String {
    let t = table.table();
    let p = prefix(table);
    let ine = if if_not_exists { "IF NOT EXISTS " } else { "" };
    let q = table.qualified();
    let middle = "    event_type      varchar(100)  NOT NULL,
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
    locked_by       varchar(255),";
    let checks = format!(
        "    CONSTRAINT \"ck_{p}_attempts_valid\"
        CHECK (attempts_made <= max_attempts),
    CONSTRAINT \"ck_{p}_completed_status_consistency\"
        CHECK ((status = 'completed' AND completed_at IS NOT NULL)
            OR (status <> 'completed' AND completed_at IS NULL)),
    CONSTRAINT \"ck_{p}_lock_consistency\"
        CHECK ((locked_at IS NULL AND locked_by IS NULL)
            OR (locked_at IS NOT NULL AND locked_by IS NOT NULL))"
    );
    let tail = "    message_id      varchar(255)  NOT NULL,
    consumer_group  varchar(255)  NOT NULL,
    source          varchar(255)  NOT NULL,";
    match layout {
        Layout::Plain => format!(
            "CREATE TABLE {ine}{q} (
    id              uuid          NOT NULL,
{middle}
    created_at      timestamptz   NOT NULL DEFAULT timezone('UTC', now()),
    updated_at      timestamptz            DEFAULT timezone('UTC', now()),
{tail}
    CONSTRAINT \"{t}_pkey\" PRIMARY KEY (id),
{checks}
)"
        ),
        Layout::Partitioned => format!(
            "CREATE TABLE {ine}{q} (
    created_at      timestamptz   NOT NULL DEFAULT timezone('UTC', now()),
    id              uuid          NOT NULL,
{middle}
    updated_at      timestamptz            DEFAULT timezone('UTC', now()),
{tail}
    CONSTRAINT \"{t}_pkey\" PRIMARY KEY (created_at, id),
{checks}
) PARTITION BY RANGE (created_at)"
        ),
    }
}

fn create_index(table: &TableName, ix: &InboxIndex, if_not_exists: bool) -> String {
    format!(
        "CREATE {u}INDEX {ine}\"{n}\" ON {q} {b}",
        u = if ix.unique { "UNIQUE " } else { "" },
        ine = if if_not_exists { "IF NOT EXISTS " } else { "" },
        n = ix.name,
        q = table.qualified(),
        b = ix.body
    )
}

/// The ancestor's DDL of Appendix D for `layout` exactly (no `IF NOT EXISTS`, no additions),
/// with the table name replaced: for tests and for users who copy the SQL.
pub fn ancestor_inbox_ddl(table: &TableName, layout: Layout) -> Vec<String> {
    std::iter::once(create_table(table, layout, false))
        .chain(
            ancestor_indexes(table, layout)
                .iter()
                .map(|ix| create_index(table, ix, false)),
        )
        .collect()
}

/// The inbox schema as plain statements, to run in order in one transaction (R172):
/// `CREATE SCHEMA IF NOT EXISTS` (when qualified), the table of Appendix D (`IF NOT EXISTS`),
/// the `partition_key` column (`ADD COLUMN IF NOT EXISTS`), the ancestor's indexes and the
/// three additions ([`addition_indexes`]; `IF NOT EXISTS`, so by name only). Schema creation
/// ([`crate::inbox::schema::create_inbox_schema_with`]) runs [`InboxSchema`] instead, which also
/// skips an index present under another name (R173). The partitioned table's partitions are
/// the user's DDL, as with the ancestor.
pub fn inbox_ddl(table: &TableName, layout: Layout) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(s) = table.schema() {
        v.push(format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""));
    }
    v.push(create_table(table, layout, true));
    v.push(format!(
        "ALTER TABLE {} ADD COLUMN IF NOT EXISTS partition_key varchar(255)",
        table.qualified()
    ));
    for ix in ancestor_indexes(table, layout)
        .iter()
        .chain(addition_indexes(table).iter())
    {
        v.push(create_index(table, ix, true));
    }
    v
}

/// The schema creation's statements, in the order the flow runs them.
#[derive(Debug, Clone)]
pub struct InboxSchema {
    /// `SELECT pg_advisory_xact_lock(hashtext($1))`, `$1 text` = [`schema_lock_key`].
    pub lock: String,
    /// `CREATE SCHEMA`, `CREATE TABLE`, `ADD COLUMN partition_key`, each `IF NOT EXISTS`.
    pub table: Vec<String>,
    /// `CREATE TEMP TABLE inbox_probe (LIKE <table>) ON COMMIT DROP`: the probe indexes' table.
    pub probe_table: String,
    /// Per index: its name, the probe index on the temp table, and the index itself.
    pub indexes: Vec<(String, String, String)>,
    /// `equivalent_index.sql`: `$1 text` the table, `$2 text` the probe index.
    pub equivalent: String,
    /// `SELECT count(*)::int8 AS n FROM pg_class WHERE oid = to_regclass($1)`: whether an index of
    /// this name exists (`$1 text` schema.name).
    pub exists: String,
}

impl InboxSchema {
    /// The schema creation of `table` in `layout`.
    pub fn new(table: &TableName, layout: Layout) -> Self {
        let all: Vec<InboxIndex> = ancestor_indexes(table, layout)
            .into_iter()
            .chain(addition_indexes(table))
            .collect();
        let probe = TableName::new("pg_temp.inbox_probe").expect("valid");
        let mut t = Vec::new();
        if let Some(s) = table.schema() {
            t.push(format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""));
        }
        t.push(create_table(table, layout, true));
        t.push(format!(
            "ALTER TABLE {} ADD COLUMN IF NOT EXISTS partition_key varchar(255)",
            table.qualified()
        ));
        Self {
            lock: "SELECT pg_advisory_xact_lock(hashtext($1::text))".into(),
            table: t,
            probe_table: format!(
                "CREATE TEMP TABLE IF NOT EXISTS inbox_probe (LIKE {}) ON COMMIT DROP",
                table.qualified()
            ),
            indexes: all
                .iter()
                .enumerate()
                .map(|(i, ix)| {
                    let p = InboxIndex {
                        name: format!("inbox_probe_{i}"),
                        ..ix.clone()
                    };
                    (
                        ix.name.clone(),
                        create_index(&probe, &p, true),
                        create_index(table, ix, true),
                    )
                })
                .collect(),
            equivalent: render(text::EQUIVALENT_INDEX, table),
            exists: "SELECT count(*)::int8 AS n FROM pg_class WHERE oid = to_regclass($1::text)"
                .into(),
        }
    }
}

/// The key of the schema-creation advisory lock (`hashtext`): `inbox-schema:` + the table.
pub fn schema_lock_key(table: &TableName) -> String {
    format!("inbox-schema:{}", table.dotted())
}

/// The statement files, one per statement kind.
mod text {
    pub const LAND: &str = include_str!("../sql/inbox/land.sql");
    pub const LAND_RUN: &str = include_str!("../sql/inbox/land_run.sql");
    pub const LOCK_ROW_RUN: &str = include_str!("../sql/inbox/lock_row_run.sql");
    pub const BY_MESSAGE_ID: &str = include_str!("../sql/inbox/by_message_id.sql");
    pub const DEDUP_LOCK: &str = include_str!("../sql/inbox/dedup_lock.sql");
    pub const DEDUP_LOCKS: &str = include_str!("../sql/inbox/dedup_locks.sql");
    pub const LOCK_ROWS: &str = include_str!("../sql/inbox/lock_rows.sql");
    pub const COMPLETE_ROWS: &str = include_str!("../sql/inbox/complete_rows.sql");
    pub const KEY_LOCK: &str = include_str!("../sql/inbox/key_lock.sql");
    pub const KEY_LOCKS: &str = include_str!("../sql/inbox/key_locks.sql");
    pub const FORGET: &str = include_str!("../sql/inbox/forget.sql");
    pub const LOCK_ROW: &str = include_str!("../sql/inbox/lock_row.sql");
    pub const EXISTS: &str = include_str!("../sql/inbox/exists.sql");
    pub const EARLIER: &str = include_str!("../sql/inbox/earlier.sql");
    pub const COMPLETED_SIBLING: &str = include_str!("../sql/inbox/completed_sibling.sql");
    pub const STATEMENT_TIMEOUT: &str = include_str!("../sql/inbox/statement_timeout.sql");
    pub const RESTORE_TIMEOUT: &str = include_str!("../sql/inbox/restore_timeout.sql");
    pub const WRITE: &str = include_str!("../sql/inbox/write.sql");
    pub const IN_LINE_ROWS: &str = include_str!("../sql/inbox/in_line_rows.sql");
    pub const TRY_LOCK: &str = include_str!("../sql/inbox/try_lock.sql");
    pub const STAMP: &str = include_str!("../sql/inbox/stamp.sql");
    pub const FETCH_HEADS: &str = include_str!("../sql/inbox/fetch_heads.sql");
    pub const FETCH_RUNS: &str = include_str!("../sql/inbox/fetch_runs.sql");
    pub const FETCH_WALK: &str = include_str!("../sql/inbox/fetch_walk.sql");
    pub const WINDOW_OVERFLOW: &str = include_str!("../sql/inbox/window_overflow.sql");
    pub const KEY_FIRST: &str = include_str!("../sql/inbox/key_first.sql");
    pub const SAME_KEY: &str = include_str!("../sql/inbox/same_key.sql");
    pub const WINDOW_UNLOCKED: &str = include_str!("../sql/inbox/window_unlocked.sql");
    pub const WINDOW_EXPIRED: &str = include_str!("../sql/inbox/window_expired.sql");
    pub const WAITING: &str = include_str!("../sql/inbox/waiting.sql");
    pub const COUNTS: &str = include_str!("../sql/inbox/counts.sql");
    pub const OLDEST_DUE_AGE: &str = include_str!("../sql/inbox/oldest_due_age.sql");
    pub const EQUIVALENT_INDEX: &str = include_str!("../sql/inbox/equivalent_index.sql");
    // The outbox's statements whose rule is the same on the inbox table.
    pub const GET: &str = include_str!("../sql/statements/get.sql");
    pub const REQUEUE: &str = include_str!("../sql/statements/requeue.sql");
    pub const PARKED_ROWS: &str = include_str!("../sql/inbox/parked_rows.sql");
    pub const PARKED_STATS: &str = include_str!("../sql/inbox/parked_stats.sql");
    pub const PARKED_KEYS: &str = include_str!("../sql/inbox/parked_keys.sql");
    pub const REDRIVE: &str = include_str!("../sql/statements/redrive.sql");
    pub const DISCARD: &str = include_str!("../sql/statements/discard.sql");
    pub const RELEASE_LOCKS: &str = include_str!("../sql/statements/release_locks.sql");
    pub const RELEASE_STALE: &str = include_str!("../sql/statements/release_stale.sql");
    pub const FORCE_UNLOCK: &str = include_str!("../sql/statements/force_unlock.sql");
    pub const DELETE_OLD_COMPLETED: &str =
        include_str!("../sql/statements/delete_old_completed.sql");
    #[cfg(feature = "test-hooks")]
    pub const SHIFT_CLOCK: &str = include_str!("../sql/statements/shift_clock.sql");
}

/// The parts the fetch statements (`fetch_heads`, `fetch_walk`, `window_overflow`) and their
/// fragments name: the group is `$1`, the sources `$2`, the lease TTL `$3` in each.
const FETCH_PARTS: [(&str, &str); 3] = [
    ("group", "$1::text"),
    ("sources", "$2::text[]"),
    ("lease_us", "$3::int8"),
];

/// A statement file made ready to send: comments dropped, fragments expanded, `{table}`
/// replaced by the quoted validated name and `{columns}` / `{t_columns}` by [`INBOX_COLUMNS`].
/// The inbox key stands for the outbox's in the shared fragments (`same_key`, `key_first`); the inbox's own
/// fragments are the fetch window's two ranges (`window_unlocked`, `window_expired`), whose
/// parameters are [`FETCH_PARTS`] (the fetch statements name them only).
fn render(src: &str, table: &TableName) -> String {
    fragments::expand_with(
        &fragments::strip(src),
        &FETCH_PARTS,
        &[
            ("key_first", text::KEY_FIRST),
            ("same_key", text::SAME_KEY),
            ("window_unlocked", text::WINDOW_UNLOCKED),
            ("window_expired", text::WINDOW_EXPIRED),
        ],
    )
    .replace("{table}", &table.qualified())
    .replace("{t_columns}", &inbox_column_list("t"))
    .replace("{columns}", &inbox_column_list(""))
    .trim()
    .to_owned()
}

/// Every inbox statement text for one table; parameters and results are documented in each
/// statement's file under `src/sql/inbox/` (or `src/sql/statements/` for the shared ones).
#[derive(Debug, Clone)]
pub struct InboxStatements {
    /// The table.
    pub table: TableName,
    /// Its layout.
    pub layout: Layout,
    /// `SELECT now()`.
    pub now: String,
    /// `land.sql`.
    pub land: String,
    /// `land_run.sql`: the runner's landing with its earlier probe and handler timeout.
    pub land_run: String,
    /// `by_message_id.sql`.
    pub by_message_id: String,
    /// `dedup_lock.sql`.
    pub dedup_lock: String,
    /// `dedup_locks.sql`: several dedup keys' locks in hash order (a runner's batch, R185; a
    /// processor's T_b, R189).
    pub dedup_locks: String,
    /// `lock_rows.sql`: a processor transaction's row locks at once (R189).
    pub lock_rows: String,
    /// `complete_rows.sql`: a processor transaction's completions at once (R189).
    pub complete_rows: String,
    /// `key_lock.sql`.
    pub key_lock: String,
    /// `key_locks.sql`: a batch's key locks in hash order (R185).
    pub key_locks: String,
    /// `forget.sql`: deletes a row the transaction landed (R185, R127).
    pub forget: String,
    /// `lock_row.sql` by id alone.
    pub lock_row: String,
    /// `lock_row.sql` by the primary key (created_at, id).
    pub lock_row_at: String,
    /// `lock_row_run.sql`: the processor's guard with its handler timeout (plain table).
    pub lock_row_run: String,
    /// `exists.sql` by id alone.
    pub exists: String,
    /// `exists.sql` by the primary key (created_at, id).
    pub exists_at: String,
    /// `earlier.sql`.
    pub earlier: String,
    /// `completed_sibling.sql`.
    pub completed_sibling: String,
    /// `SAVEPOINT inbox_run`.
    pub savepoint: String,
    /// `RELEASE SAVEPOINT inbox_run`.
    pub release_savepoint: String,
    /// `ROLLBACK TO SAVEPOINT inbox_run`.
    pub rollback_to_savepoint: String,
    /// `statement_timeout.sql`.
    pub statement_timeout: String,
    /// `restore_timeout.sql`.
    pub restore_timeout: String,
    /// `write.sql` by id alone.
    pub write: String,
    /// `write.sql` by the primary key (created_at, id).
    pub write_at: String,
    /// `in_line_rows.sql`.
    pub in_line_rows: String,
    /// `try_lock.sql`.
    pub try_lock: String,
    /// `stamp.sql`.
    pub stamp: String,
    /// `fetch_heads.sql`.
    pub fetch_heads: String,
    /// `fetch_runs.sql`.
    pub fetch_runs: String,
    /// `fetch_walk.sql`.
    pub fetch_walk: String,
    /// `window_overflow.sql`.
    pub window_overflow: String,
    /// `waiting.sql`.
    pub waiting: String,
    /// `counts.sql`.
    pub counts: String,
    /// `oldest_due_age.sql`.
    pub oldest_due_age: String,
    /// The outbox's `get.sql` with the inbox columns.
    pub get: String,
    /// The outbox's `requeue.sql` (failed or parked rows, R192).
    pub requeue: String,
    /// `parked_rows.sql` (R192).
    pub parked_rows: String,
    /// `parked_stats.sql`: the group's parked rows (R193).
    pub parked_stats: String,
    /// `parked_keys.sql`: the group's parked keys (R193).
    pub parked_keys: String,
    /// The outbox's `redrive.sql` (R192).
    pub redrive: String,
    /// The outbox's `discard.sql` (R192).
    pub discard: String,
    /// The outbox's `release_locks.sql`.
    pub release_locks: String,
    /// The outbox's `release_stale.sql` (one batch).
    pub release_stale: String,
    /// The outbox's `force_unlock.sql`.
    pub force_unlock: String,
    /// The outbox's `delete_old_completed.sql`.
    pub delete_old_completed: String,
    /// The outbox's `shift_clock.sql` (the test clock of the conformance harness; cargo feature
    /// `test-hooks`, for tests only).
    #[cfg(feature = "test-hooks")]
    pub shift_clock: String,
}

impl InboxStatements {
    /// Every statement for `table` in `layout`.
    pub fn new(table: &TableName, layout: Layout) -> Self {
        let r = |src: &str| render(src, table);
        // The two forms of a by-id statement (`{at}`, see lock_row.sql): by id alone, and by
        // the primary key of both layouts with the created_at parameter each file names.
        let by_id = |src: &str| r(src).replace(" {at}", "");
        let at = |src: &str, created_at: &str| r(src).replace("{at}", created_at);
        Self {
            table: table.clone(),
            layout,
            now: "SELECT now()".into(),
            land: r(text::LAND),
            land_run: r(&text::LAND_RUN.replace("{land}", &fragments::strip(text::LAND))),
            by_message_id: r(text::BY_MESSAGE_ID),
            dedup_lock: r(text::DEDUP_LOCK),
            dedup_locks: r(text::DEDUP_LOCKS),
            lock_rows: r(text::LOCK_ROWS),
            complete_rows: r(text::COMPLETE_ROWS),
            key_lock: r(text::KEY_LOCK),
            key_locks: r(text::KEY_LOCKS),
            forget: r(text::FORGET),
            lock_row: by_id(text::LOCK_ROW),
            lock_row_at: at(text::LOCK_ROW, "AND created_at = $2::timestamptz"),
            lock_row_run: r(text::LOCK_ROW_RUN),
            exists: by_id(text::EXISTS),
            exists_at: at(text::EXISTS, "AND created_at = $2::timestamptz"),
            earlier: r(text::EARLIER),
            completed_sibling: r(text::COMPLETED_SIBLING),
            savepoint: "SAVEPOINT inbox_run".into(),
            release_savepoint: "RELEASE SAVEPOINT inbox_run".into(),
            rollback_to_savepoint: "ROLLBACK TO SAVEPOINT inbox_run".into(),
            statement_timeout: r(text::STATEMENT_TIMEOUT),
            restore_timeout: r(text::RESTORE_TIMEOUT),
            write: by_id(text::WRITE),
            write_at: at(text::WRITE, "AND t.created_at = $7::timestamptz"),
            in_line_rows: r(text::IN_LINE_ROWS),
            try_lock: r(text::TRY_LOCK),
            stamp: r(text::STAMP),
            fetch_heads: r(text::FETCH_HEADS),
            fetch_runs: r(text::FETCH_RUNS),
            fetch_walk: r(text::FETCH_WALK),
            window_overflow: r(text::WINDOW_OVERFLOW),
            waiting: r(text::WAITING),
            counts: r(text::COUNTS),
            oldest_due_age: r(text::OLDEST_DUE_AGE),
            get: r(text::GET),
            requeue: r(text::REQUEUE),
            parked_rows: r(text::PARKED_ROWS),
            parked_stats: r(text::PARKED_STATS),
            parked_keys: r(text::PARKED_KEYS),
            redrive: r(text::REDRIVE),
            discard: r(text::DISCARD),
            release_locks: r(text::RELEASE_LOCKS),
            release_stale: r(text::RELEASE_STALE),
            force_unlock: r(text::FORCE_UNLOCK),
            delete_old_completed: r(text::DELETE_OLD_COMPLETED),
            #[cfg(feature = "test-hooks")]
            shift_clock: r(text::SHIFT_CLOCK),
        }
    }
}

impl InboxStatements {
    /// The statement texts for `pooler` (R194), marked as [`crate::sql::Statements::for_pooler`] marks the
    /// outbox's. Every field is named below, so a statement added without being marked is a
    /// compile error here.
    pub fn for_pooler(mut self, pooler: crate::sql::Pooler) -> Self {
        let InboxStatements {
            table: _,
            layout: _,
            now,
            land,
            land_run,
            by_message_id,
            dedup_lock,
            key_lock,
            lock_row,
            lock_row_at,
            lock_row_run,
            exists,
            exists_at,
            earlier,
            completed_sibling,
            savepoint,
            release_savepoint,
            rollback_to_savepoint,
            statement_timeout,
            restore_timeout,
            write,
            write_at,
            in_line_rows,
            try_lock,
            stamp,
            fetch_heads,
            fetch_runs,
            fetch_walk,
            window_overflow,
            waiting,
            counts,
            oldest_due_age,
            get,
            requeue,
            release_locks,
            release_stale,
            force_unlock,
            delete_old_completed,
            dedup_locks,
            lock_rows,
            complete_rows,
            parked_rows,
            parked_stats,
            parked_keys,
            redrive,
            discard,
            key_locks,
            forget,
            #[cfg(feature = "test-hooks")]
            shift_clock,
        } = &mut self;
        for s in [
            now,
            land,
            land_run,
            by_message_id,
            dedup_lock,
            key_lock,
            lock_row,
            lock_row_at,
            lock_row_run,
            exists,
            exists_at,
            earlier,
            completed_sibling,
            savepoint,
            release_savepoint,
            rollback_to_savepoint,
            statement_timeout,
            restore_timeout,
            write,
            write_at,
            in_line_rows,
            try_lock,
            stamp,
            fetch_heads,
            fetch_runs,
            fetch_walk,
            window_overflow,
            waiting,
            counts,
            oldest_due_age,
            get,
            requeue,
            release_locks,
            release_stale,
            force_unlock,
            delete_old_completed,
            dedup_locks,
            lock_rows,
            complete_rows,
            parked_rows,
            parked_stats,
            parked_keys,
            redrive,
            discard,
            key_locks,
            forget,
            #[cfg(feature = "test-hooks")]
            shift_clock,
        ] {
            crate::sql::pooler::mark(s, pooler);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_render_completely() {
        let t = TableName::new("ops.inbox_events").unwrap();
        let s = InboxStatements::new(&t, Layout::Plain);
        for text in [
            &s.land,
            &s.land_run,
            &s.lock_row_run,
            &s.lock_row,
            &s.lock_row_at,
            &s.lock_rows,
            &s.complete_rows,
            &s.exists_at,
            &s.write_at,
            &s.by_message_id,
            &s.earlier,
            &s.write,
            &s.in_line_rows,
            &s.stamp,
            &s.fetch_heads,
            &s.fetch_runs,
            &s.fetch_walk,
            &s.window_overflow,
            &s.get,
            &s.requeue,
            &s.parked_rows,
            &s.parked_stats,
            &s.parked_keys,
            &s.redrive,
            &s.discard,
            &s.release_stale,
            &s.waiting,
            &s.counts,
            &s.oldest_due_age,
        ] {
            assert!(!text.contains('{') && !text.contains("--"), "{text}");
            assert!(text.contains("\"ops\".\"inbox_events\""), "{text}");
            assert!(!text.contains("topic"), "{text}");
        }
    }

    #[test]
    fn index_names_follow_r173() {
        let plain = TableName::new("inbox_events").unwrap();
        let part = TableName::new("inbox_events_partitioned").unwrap();
        let other = TableName::new("s.my_inbox").unwrap();
        let names = |t: &TableName, l: Layout| -> Vec<String> {
            ancestor_indexes(t, l).into_iter().map(|i| i.name).collect()
        };
        assert_eq!(names(&plain, Layout::Plain)[0], "idx_inbox_deduplication");
        assert!(names(&plain, Layout::Plain).contains(&"idx_inbox_events_pending_fetch".into()));
        assert_eq!(
            names(&part, Layout::Partitioned)[0],
            "idx_inbox_events_p_deduplication"
        );
        assert!(
            names(&part, Layout::Partitioned)
                .contains(&"idx_inbox_events_p_message_consumer".into())
        );
        assert_eq!(
            names(&other, Layout::Plain)[0],
            "idx_my_inbox_deduplication"
        );
        let ddl = inbox_ddl(&part, Layout::Partitioned).join(";\n");
        assert!(ddl.contains("\"inbox_events_partitioned_pkey\" PRIMARY KEY (created_at, id)"));
        assert!(ddl.contains("\"ck_inbox_events_p_lock_consistency\""));
        assert!(ddl.contains("\"idx_inbox_events_p_pending_key_order\""));
        assert_eq!(ancestor_inbox_ddl(&plain, Layout::Plain).len(), 8);
        assert_eq!(ancestor_inbox_ddl(&part, Layout::Partitioned).len(), 9);
    }
}
