//! The statement texts of one table ([`Statements`]), rendered from the `.sql` files.

use super::*;

// ---------------------------------------------------------------------------------------------
// Statements
// ---------------------------------------------------------------------------------------------

/// Every statement text for one table. Build once with [`Statements::new`]; the fields are
/// plain SQL with numbered parameters, documented one by one.
///
/// Part of the driver layer ([`crate::driver`]): it serves backend implementers, and its fields
/// are exempt from semver.
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

    /// `SELECT pg_notify($1, $2)`; `$1 text` the channel, `$2 text` the payload. The wake-up
    /// check's probe (R196, [`crate::wake`]), in a transaction of its own.
    pub notify_probe: String,

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
    /// last key ([`HeadRows`] reads them). Run it in the lease fetch's transaction, then
    /// [`Statements::fetch_take`]; transaction delivery runs
    /// [`Statements::fetch_heads_autocommit`] instead.
    ///
    /// How it stays flat: path A reads the `window` oldest fetchable rows, row-locking them
    /// with `SKIP LOCKED` as it reads them (concurrent relays read disjoint windows), reduces
    /// them to one per key and probes each for an earlier in-line row; path B, only when path A
    /// found fewer heads than the batch, walks keys from the cursor for at most `walk_limit`
    /// keys and stops after a batch of heads. No advisory lock is taken, and no work or lock
    /// grows with the number of keys, rows behind blocked heads, or completed rows (R85).
    pub fetch_heads: String,

    /// [`Statements::fetch_heads`] for autocommit, its own transaction (transaction delivery
    /// runs it before it begins the delivery transaction, so the window's row locks end with
    /// it): the same statement, which also sets synchronous_commit off for its own transaction
    /// (it writes nothing but row locks). Same parameters and rows. Never run it inside a
    /// transaction whose commit must be durable.
    pub fetch_heads_autocommit: String,

    /// Fetch, second statement, lease delivery (R21, R76): lock the candidate heads in order
    /// until the batch is full, extend them into runs (R74), lock the run rows, stamp the
    /// lease. Text and parameters: `statements/fetch_take.sql` + `fetch_take_lease.sql`.
    /// Returns [`COLUMNS`] of the taken rows in return order (R22). Commit right after.
    pub fetch_take: String,

    /// Fetch, second statement, transaction delivery (R84): as [`Statements::fetch_take`]
    /// without the lease stamp (`fetch_take_transaction.sql`); the rows stay row-locked until
    /// the cycle's transaction ends. One more parameter, `$9 text`: the transaction's
    /// server-side idle bound in milliseconds, which it sets (transaction-local). Run it as the
    /// first statement of the delivery transaction.
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

    /// requeue_failed (R64, R192): `$1 uuid`. Affects 1 row when the row was `failed` or
    /// parked, else 0.
    pub requeue: String,

    /// The parked rows a redrive or discard selects (R192): `statements/parked_rows.sql`,
    /// `$1 uuid[]` ids, `$2 text[]` topics, `$3 text[]` partition keys (each NULL for any).
    /// Returns [`COLUMNS`] in write order, row-locked.
    pub parked_rows: String,

    /// Redrive (R192): `statements/redrive.sql`, `$1 uuid[]` ids. Returns the outcome
    /// statements' `id, status, attempts_made, scheduled_at` of the rows written.
    pub redrive: String,

    /// Discard (R192): `statements/discard.sql`, `$1 uuid[]` ids, `$2 text[]` last_error.
    /// Returns as [`Statements::redrive`].
    pub discard: String,

    /// The parked gauges (R193): `statements/parked_stats.sql`, no parameters. Returns one
    /// row `keys int8, rows int8`.
    pub parked_stats: String,

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

    /// Drain check of the relay binary: `statements/drained.sql`, no parameters. Returns one
    /// row, one column `drained bool`: no pending row held, and no due head.
    pub drained: String,

    /// Failed ids of a topic and/or key (the relay binary's requeue): `statements/failed_ids.sql`,
    /// `$1 text` topic and `$2 text` partition_key, each NULL for any. Returns `id uuid` per
    /// failed row, oldest first.
    pub failed_ids: String,

    /// What stands under the table's name (the relay binary's checks before `run` and
    /// `migrate`): `statements/table_kind.sql`, `$1 text` the dotted table name. Returns at most
    /// one row, one column `relkind text` (`r` plain, `p` partitioned).
    pub table_kind: String,

    /// Test clock (the conformance harness's `advance`; cargo feature `test-hooks`, for tests
    /// only): `$1 int8` microseconds. Moves created_at, scheduled_at, locked_at, completed_at and
    /// updated_at of every row back by that much.
    #[cfg(feature = "test-hooks")]
    pub shift_clock: String,
}

/// The statement texts, one `.sql` file each under `src/sql/statements/`, with their
/// parameters and result columns documented in the file. Rendered by [`render`].
pub(super) mod text {
    pub const FETCH_HEADS: &str = include_str!("statements/fetch_heads.sql");
    pub const FETCH_TAKE: &str = include_str!("statements/fetch_take.sql");
    pub const FETCH_TAKE_LEASE: &str = include_str!("statements/fetch_take_lease.sql");
    pub const FETCH_TAKE_TRANSACTION: &str = include_str!("statements/fetch_take_transaction.sql");
    pub const GET: &str = include_str!("statements/get.sql");
    pub const COMPLETE: &str = include_str!("statements/complete.sql");
    pub const FAIL: &str = include_str!("statements/fail.sql");
    pub const RELEASE: &str = include_str!("statements/release.sql");
    pub const REFRESH_LOCK: &str = include_str!("statements/refresh_lock.sql");
    pub const RELEASE_LOCK: &str = include_str!("statements/release_lock.sql");
    pub const RELEASE_LOCKS: &str = include_str!("statements/release_locks.sql");
    pub const RELEASE_STALE: &str = include_str!("statements/release_stale.sql");
    pub const REQUEUE: &str = include_str!("statements/requeue.sql");
    pub const PARKED_ROWS: &str = include_str!("statements/parked_rows.sql");
    pub const REDRIVE: &str = include_str!("statements/redrive.sql");
    pub const DISCARD: &str = include_str!("statements/discard.sql");
    pub const PARKED_STATS: &str = include_str!("statements/parked_stats.sql");
    pub const DELETE_OLD_COMPLETED: &str = include_str!("statements/delete_old_completed.sql");
    pub const FORCE_UNLOCK: &str = include_str!("statements/force_unlock.sql");
    pub const BLOCKED_KEYS: &str = include_str!("statements/blocked_keys.sql");
    pub const COUNTS: &str = include_str!("statements/counts.sql");
    pub const OLDEST_DUE_AGE: &str = include_str!("statements/oldest_due_age.sql");
    pub const DRAINED: &str = include_str!("statements/drained.sql");
    pub const FAILED_IDS: &str = include_str!("statements/failed_ids.sql");
    pub const TABLE_KIND: &str = include_str!("statements/table_kind.sql");
    #[cfg(feature = "test-hooks")]
    pub const SHIFT_CLOCK: &str = include_str!("statements/shift_clock.sql");
}

/// A statement file made ready to send: comment lines (`--`) dropped, each `(name, text)` of
/// `parts` substituted for `{name}` and each fragment `{name:alias}` expanded (see
/// `fragments`), then `{table}` replaced by the quoted, validated table name and `{columns}` /
/// `{t_columns}` by [`COLUMNS`] (bare / with alias `t`).
pub(super) fn render(src: &str, table: &TableName, parts: &[(&str, &str)]) -> String {
    fragments::expand(&fragments::strip(src), parts)
        .replace("{table}", &table.qualified())
        .replace("{t_columns}", &column_list("t"))
        .replace("{columns}", &column_list(""))
        .trim()
        .to_owned()
}

/// The parts of [`Statements::fetch_heads`]: the bind parameters its fragments name, and
/// `own_commit`, empty, or for [`Statements::fetch_heads_autocommit`] the clause that makes
/// the statement's own transaction commit without waiting for the WAL flush.
pub(super) fn heads_parts(autocommit: bool) -> [(&'static str, &'static str); 5] {
    [
        ("lease_us", "$2::int8"),
        ("topics", "$3::text[]"),
        ("aggregate_types", "$4::text[]"),
        ("aggregate_ids", "$5::uuid[]"),
        (
            "own_commit",
            if autocommit {
                "WHERE (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"
            } else {
                ""
            },
        ),
    ]
}

/// The parts of [`Statements::fetch_take`]: the bind parameters its fragments name and its
/// `finish` (lease stamp or transaction delivery).
pub(super) fn take_parts(finish: &str) -> [(&str, &str); 5] {
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
            notify_probe: "SELECT pg_notify($1::text, $2::text)".into(),
            get: r(text::GET),
            insert: insert_statement(&t, &cols, ""),
            select_existing: format!(
                "SELECT {cols} FROM {t} WHERE id = ANY($1::uuid[]) OR idempotency_key = ANY($2::text[])"
            ),
            fetch_heads: render(text::FETCH_HEADS, table, &heads_parts(false)),
            fetch_heads_autocommit: render(text::FETCH_HEADS, table, &heads_parts(true)),
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
            release: r(text::RELEASE),
            refresh_lock: r(text::REFRESH_LOCK),
            release_lock: r(text::RELEASE_LOCK),
            release_locks: r(text::RELEASE_LOCKS),
            release_stale: r(text::RELEASE_STALE),
            requeue: r(text::REQUEUE),
            parked_rows: r(text::PARKED_ROWS),
            redrive: r(text::REDRIVE),
            discard: r(text::DISCARD),
            parked_stats: r(text::PARKED_STATS),
            delete_old_completed: r(text::DELETE_OLD_COMPLETED),
            force_unlock: r(text::FORCE_UNLOCK),
            blocked_keys: r(text::BLOCKED_KEYS),
            counts: r(text::COUNTS),
            oldest_due_age: r(text::OLDEST_DUE_AGE),
            drained: r(text::DRAINED),
            failed_ids: r(text::FAILED_IDS),
            table_kind: r(text::TABLE_KIND),
            #[cfg(feature = "test-hooks")]
            shift_clock: r(text::SHIFT_CLOCK),
        }
    }

    /// The key for [`Statements::schema_lock`]: `outbox-schema:` + the dotted table name.
    pub fn schema_lock_key(&self) -> String {
        format!("outbox-schema:{}", self.table.dotted())
    }
}

impl Statements {
    /// The statement texts for `pooler` (R194): under [`Pooler::Transaction`] each text starts
    /// with [`super::pooler::UNPREPARED`], which the drivers read as "unnamed, uncached, inside
    /// a transaction". Every field is named below, so a statement added to the set without
    /// being marked is a compile error here.
    pub fn for_pooler(mut self, pooler: Pooler) -> Self {
        let Statements {
            table: _,
            layout: _,
            idempotency_lock,
            schema_lock,
            now,
            notify,
            notify_probe,
            get,
            insert,
            select_existing,
            fetch_heads,
            fetch_heads_autocommit,
            fetch_take,
            fetch_take_transaction,
            complete,
            fail,
            complete_in_delivery,
            fail_in_delivery,
            release,
            refresh_lock,
            release_lock,
            release_locks,
            release_stale,
            requeue,
            delete_old_completed,
            force_unlock,
            blocked_keys,
            counts,
            oldest_due_age,
            drained,
            failed_ids,
            table_kind,
            parked_rows,
            redrive,
            discard,
            parked_stats,
            #[cfg(feature = "test-hooks")]
            shift_clock,
        } = &mut self;
        if let Some(s) = idempotency_lock {
            pooler::mark(s, pooler);
        }
        for s in [
            schema_lock,
            now,
            notify,
            notify_probe,
            get,
            insert,
            select_existing,
            fetch_heads,
            fetch_heads_autocommit,
            fetch_take,
            fetch_take_transaction,
            complete,
            fail,
            complete_in_delivery,
            fail_in_delivery,
            release,
            refresh_lock,
            release_lock,
            release_locks,
            release_stale,
            requeue,
            delete_old_completed,
            force_unlock,
            blocked_keys,
            counts,
            oldest_due_age,
            drained,
            failed_ids,
            table_kind,
            parked_rows,
            redrive,
            discard,
            parked_stats,
            #[cfg(feature = "test-hooks")]
            shift_clock,
        ] {
            pooler::mark(s, pooler);
        }
        self
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
