//! The schema: indexes and the DDL of the plain layout.

use super::*;

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
///
/// And `idx_<t>_parked` on `(created_at, id)` over the parked rows (pending with attempts_made
/// ≥ max_attempts, R191, R193): the blocked keys, the parked gauges and the operator's redrive
/// and discard find parked rows in it within R85's bound, whatever the backlog.
pub fn additions(table: &TableName) -> Vec<IndexDef> {
    vec![
        IndexDef {
            name: window_index(table),
            unique: false,
            body: format!(
                "(scheduled_at, created_at, id) WHERE {}",
                fragments::fragment("window", "")
            ),
        },
        IndexDef {
            name: table.derived("idx_", "_parked"),
            unique: false,
            body: PARKED_INDEX_BODY.to_owned(),
        },
    ]
}

/// The columns and predicate of `idx_<t>_parked` (R193), on the outbox and the inbox tables.
pub const PARKED_INDEX_BODY: &str =
    "(created_at, id) WHERE status = 'pending' AND attempts_made >= max_attempts";

/// The name of the window index ([`additions`]).
pub fn window_index(table: &TableName) -> String {
    table.derived("idx_", "_pending_window")
}

/// The name of the key-order index (R33).
pub fn key_order_index(table: &TableName) -> String {
    table.derived("idx_", "_pending_key_order")
}

pub(super) fn create_table(table: &TableName, if_not_exists: bool, layout: Layout) -> String {
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

pub(super) fn create_index(
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

#[cfg(test)]
/// The ancestor's DDL exactly as the ancestor library created it (R78) (no `IF NOT EXISTS`), with the
/// table name replaced; for this module's unit test (the suite has its own copy in
/// `txoutbox_conformance::scenarios::pg::ancestor_ddl`).
pub fn ancestor_ddl(table: &TableName) -> Vec<String> {
    let mut v = vec![create_table(table, false, Layout::Plain)];
    for ix in indexes(table) {
        v.push(create_index(table, &ix, false, false));
    }
    v
}
