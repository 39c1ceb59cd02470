//! The inbox table's schema on PostgreSQL (scenarios Z-01 to Z-03): Appendix D exactly, table
//! names by R173, schema creation on an existing ancestor table.

use sqlx::{AssertSqlSafe, PgPool, Row};
use txoutbox_postgres::inbox::create_inbox_schema;
use txoutbox_postgres::inbox::sql::ancestor_inbox_ddl;
use txoutbox_postgres::sql::{Layout, TableName};
use txoutbox_testkit::fixtures;
use txoutbox_testkit::{
    HARNESS_SHARE, database_url, fresh_schema_name, reserve_connections, trial_pool,
};

async fn pool() -> (PgPool, txoutbox_testkit::ConnectionShare) {
    let share = reserve_connections(HARNESS_SHARE).await;
    (trial_pool(&database_url(), 2).await, share)
}

async fn columns(pool: &PgPool, schema: &str, table: &str) -> Vec<String> {
    sqlx::query(
        "SELECT a.attname::text || ' ' || format_type(a.atttypid, a.atttypmod) \
         || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END \
         || COALESCE(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '') \
           FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
          WHERE a.attrelid = ($1 || '.' || $2)::regclass AND a.attnum > 0 AND NOT a.attisdropped \
          ORDER BY a.attnum",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

async fn constraints(pool: &PgPool, schema: &str, table: &str) -> Vec<String> {
    sqlx::query(
        "SELECT conname::text || ': ' || pg_get_constraintdef(oid) FROM pg_constraint \
          WHERE conrelid = ($1 || '.' || $2)::regclass ORDER BY conname",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// `name: UNIQUE? (columns) WHERE predicate`, sorted by name.
async fn indexes(pool: &PgPool, schema: &str, table: &str) -> Vec<String> {
    sqlx::query(
        "SELECT c.relname::text || ': ' || regexp_replace(pg_get_indexdef(x.indexrelid), \
                '^CREATE (UNIQUE )?INDEX \\S+ ON (ONLY )?\\S+ (USING btree )?', CASE WHEN x.indisunique THEN 'UNIQUE ' ELSE '' END) \
           FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid \
          WHERE x.indrelid = ($1 || '.' || $2)::regclass ORDER BY c.relname",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

const COMMON_MIDDLE: [&str; 16] = [
    "event_type character varying(100) NOT NULL",
    "payload jsonb NOT NULL",
    "headers jsonb",
    "trace_id character varying(64)",
    "idempotency_key character varying(128)",
    "correlation_id character varying(64)",
    "causation_id character varying(64)",
    "schema_version character varying(50)",
    "status character varying(20) NOT NULL",
    "attempts_made integer NOT NULL",
    "max_attempts integer NOT NULL",
    "last_error character varying(2000)",
    "scheduled_at timestamp with time zone NOT NULL",
    "completed_at timestamp with time zone",
    "locked_at timestamp with time zone",
    "locked_by character varying(255)",
];
const CREATED: &str =
    "created_at timestamp with time zone NOT NULL DEFAULT timezone('UTC'::text, now())";
const UPDATED: &str = "updated_at timestamp with time zone DEFAULT timezone('UTC'::text, now())";
const TAIL: [&str; 4] = [
    "message_id character varying(255) NOT NULL",
    "consumer_group character varying(255) NOT NULL",
    "source character varying(255) NOT NULL",
    "partition_key character varying(255)",
];

fn checks(p: &str) -> Vec<String> {
    vec![
        format!("ck_{p}_attempts_valid: CHECK ((attempts_made <= max_attempts))"),
        format!(
            "ck_{p}_completed_status_consistency: CHECK (((((status)::text = 'completed'::text) AND (completed_at IS NOT NULL)) OR (((status)::text <> 'completed'::text) AND (completed_at IS NULL))))"
        ),
        format!(
            "ck_{p}_lock_consistency: CHECK ((((locked_at IS NULL) AND (locked_by IS NULL)) OR ((locked_at IS NOT NULL) AND (locked_by IS NOT NULL))))"
        ),
    ]
}

const PENDING_FETCH: &str = "(scheduled_at) WHERE (((status)::text = 'pending'::text) AND (locked_at IS NULL) AND (attempts_made < max_attempts))";
const CLEANUP: &str =
    "(completed_at) WHERE (((status)::text = 'completed'::text) AND (completed_at IS NOT NULL))";
const KEY_ORDER: &str = "(consumer_group, source, partition_key, created_at) WHERE (((status)::text = 'pending'::text) AND (partition_key IS NOT NULL))";
const GROUP: &str = "(consumer_group, scheduled_at) WHERE ((status)::text = 'pending'::text)";
const WINDOW: &str = "(consumer_group, scheduled_at, created_at, id) WHERE ((((status)::text COLLATE \"C\") = 'pending'::text) AND (locked_at IS NULL) AND (attempts_made < max_attempts))";
/// The parked rows' index (R193).
const PARKED: &str = "(created_at, id) WHERE (((status)::text = 'pending'::text) AND (attempts_made >= max_attempts))";

/// Z-01: the plain and the partitioned table are Appendix D's, column for column, with the
/// ancestor's constraint and index names, plus Appendix D's three additions (partition_key,
/// the key-order and the group index) and the library's fetch window index
/// (`idx_<p>_pending_window`, issue 21), and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_01() {
    let (pool, _share) = pool().await;
    let schema = fresh_schema_name();
    for layout in [Layout::Plain, Layout::Partitioned] {
        let name = match layout {
            Layout::Plain => "inbox_events",
            Layout::Partitioned => "inbox_events_partitioned",
        };
        let t = TableName::new(&format!("{schema}.{name}")).unwrap();
        create_inbox_schema(&pool, &t, layout).await.unwrap();
        let mut want: Vec<String> = Vec::new();
        if layout == Layout::Partitioned {
            want.push(CREATED.into());
        }
        want.push("id uuid NOT NULL".into());
        want.extend(COMMON_MIDDLE.iter().map(|s| (*s).to_owned()));
        if layout == Layout::Plain {
            want.push(CREATED.into());
        }
        want.push(UPDATED.into());
        want.extend(TAIL.iter().map(|s| (*s).to_owned()));
        assert_eq!(columns(&pool, &schema, name).await, want, "{layout:?}");
        let (p, pkey) = match layout {
            Layout::Plain => ("inbox_events", "PRIMARY KEY (id)"),
            Layout::Partitioned => ("inbox_events_p", "PRIMARY KEY (created_at, id)"),
        };
        let mut cons = checks(p);
        cons.push(format!("{name}_pkey: {pkey}"));
        cons.sort();
        assert_eq!(constraints(&pool, &schema, name).await, cons, "{layout:?}");
        let i = |suffix: &str, body: &str| format!("idx_{p}_{suffix}: {body}");
        let mut want_ix = match layout {
            Layout::Plain => vec![
                "idx_inbox_deduplication: UNIQUE (message_id, consumer_group)".to_owned(),
                i("completed_cleanup", CLEANUP),
                i("created_at", "(created_at)"),
                i(
                    "idempotency_key",
                    "UNIQUE (idempotency_key) WHERE (idempotency_key IS NOT NULL)",
                ),
                i("locked_at", "(locked_at) WHERE (locked_at IS NOT NULL)"),
                i("pending_fetch", PENDING_FETCH),
                i("updated_at", "(updated_at)"),
                "inbox_events_pkey: UNIQUE (id)".to_owned(),
            ],
            Layout::Partitioned => vec![
                i(
                    "deduplication",
                    "UNIQUE (message_id, consumer_group, created_at)",
                ),
                i("message_consumer", "(message_id, consumer_group)"),
                i(
                    "idempotency_key",
                    "UNIQUE (idempotency_key, created_at) WHERE (idempotency_key IS NOT NULL)",
                ),
                i("completed_cleanup", CLEANUP),
                i("created_at", "(created_at)"),
                i("locked_at", "(locked_at) WHERE (locked_at IS NOT NULL)"),
                i("pending_fetch", PENDING_FETCH),
                i("updated_at", "(updated_at)"),
                "inbox_events_partitioned_pkey: UNIQUE (created_at, id)".to_owned(),
            ],
        };
        want_ix.push(i("pending_key_order", KEY_ORDER));
        want_ix.push(i("pending_group", GROUP));
        want_ix.push(i("pending_window", WINDOW));
        want_ix.push(i("parked", PARKED));
        want_ix.sort();
        let got: Vec<String> = indexes(&pool, &schema, name)
            .await
            .into_iter()
            .map(|s| s.replace("USING btree ", ""))
            .collect();
        assert_eq!(got, want_ix, "{layout:?}");
    }
    sqlx::raw_sql(AssertSqlSafe(fixtures::drop_schema(&schema)))
        .execute(&pool)
        .await
        .unwrap();
}

/// Z-02: table names (R173): rejected when invalid; a custom name is the prefix of every
/// constraint and index, unshortened up to 31 characters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_02() {
    assert!(TableName::new("inbox_events").is_ok());
    assert!(TableName::new("svc_inbox").is_ok());
    assert!(TableName::new("ops.svc_inbox").is_ok());
    assert!(TableName::new("Inbox").is_err());
    assert!(TableName::new(&"i".repeat(31)).is_ok());
    assert!(TableName::new(&"i".repeat(32)).is_err());
    let (pool, _share) = pool().await;
    let schema = fresh_schema_name();
    let long = "i".repeat(31);
    for name in ["svc_inbox", long.as_str()] {
        let t = TableName::new(&format!("{schema}.{name}")).unwrap();
        create_inbox_schema(&pool, &t, Layout::Plain).await.unwrap();
        let cons = constraints(&pool, &schema, name).await;
        assert!(
            cons.iter()
                .any(|c| c.starts_with(&format!("ck_{name}_lock_consistency:"))),
            "{cons:?}"
        );
        assert!(cons.iter().any(|c| c.starts_with(&format!("{name}_pkey:"))));
        let ix = indexes(&pool, &schema, name).await;
        assert!(
            ix.iter()
                .any(|c| c.starts_with(&format!("idx_{name}_deduplication:"))),
            "{ix:?}"
        );
        assert!(
            ix.iter()
                .any(|c| c.starts_with(&format!("idx_{name}_pending_key_order:"))),
            "{ix:?}"
        );
    }
    sqlx::raw_sql(AssertSqlSafe(fixtures::drop_schema(&schema)))
        .execute(&pool)
        .await
        .unwrap();
}

/// Z-03: schema creation on an existing ancestor table adds exactly the additions (the
/// partition_key column, the key-order, group and window indexes) and is then a no-op; on a
/// table whose indexes carry the ancestor's fixed names, no index is added twice under a second
/// name; rows are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_03() {
    let (pool, _share) = pool().await;
    let schema = fresh_schema_name();
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&pool)
        .await
        .unwrap();
    let ancestor = TableName::new(&format!("{schema}.inbox_events")).unwrap();
    let q = ancestor.qualified();
    for (name, target) in [
        ("inbox_events", q.clone()),
        ("svc_inbox", format!("\"{schema}\".\"svc_inbox\"")),
    ] {
        // The ancestor's model creates svc_inbox with the inbox_events names (R173).
        for stmt in ancestor_inbox_ddl(&ancestor, Layout::Plain) {
            let stmt = stmt
                .replace(&format!("{q} ("), &format!("{target} ("))
                .replace(&format!("ON {q} "), &format!("ON {target} "));
            let stmt = if name == "svc_inbox" {
                // Index names are schema-wide: the second table's copies need other names,
                // as the ancestor's model in another schema would have; keep the prefix.
                stmt.replace("\"idx_inbox_", "\"idx_inbox_svc_")
                    .replace("\"inbox_events_pkey\"", "\"svc_pkey\"")
            } else {
                stmt
            };
            sqlx::raw_sql(AssertSqlSafe(stmt))
                .execute(&pool)
                .await
                .unwrap();
        }
        for i in 0..2 {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {target} (id, event_type, payload, status, attempts_made, max_attempts, scheduled_at, message_id, consumer_group, source) \
                 VALUES (gen_random_uuid(), 'e', '{{\"n\": 1}}', 'pending', 0, 6, now(), $1, 'g', 'src')"
            )))
            .bind(format!("m{i}"))
            .execute(&pool)
            .await
            .unwrap();
        }
        let t = TableName::new(&format!("{schema}.{name}")).unwrap();
        let cols_before = columns(&pool, &schema, name).await;
        let ix_before = indexes(&pool, &schema, name).await;
        create_inbox_schema(&pool, &t, Layout::Plain).await.unwrap();
        let cols_after = columns(&pool, &schema, name).await;
        let ix_after = indexes(&pool, &schema, name).await;
        assert_eq!(
            cols_after.len(),
            cols_before.len() + 1,
            "{name}: partition_key added"
        );
        assert!(cols_after.last().unwrap().starts_with("partition_key "));
        let added: Vec<&String> = ix_after.iter().filter(|i| !ix_before.contains(i)).collect();
        assert_eq!(
            added.len(),
            4,
            "{name}: exactly the four index additions: {added:?}"
        );
        assert!(
            added
                .iter()
                .any(|i| i.starts_with(&format!("idx_{name}_parked:")))
        );
        assert!(
            added
                .iter()
                .any(|i| i.starts_with(&format!("idx_{name}_pending_key_order:")))
        );
        assert!(
            added
                .iter()
                .any(|i| i.starts_with(&format!("idx_{name}_pending_group:")))
        );
        assert!(
            added
                .iter()
                .any(|i| i.starts_with(&format!("idx_{name}_pending_window:")))
        );
        assert_eq!(ix_after.len(), ix_before.len() + 4);
        create_inbox_schema(&pool, &t, Layout::Plain).await.unwrap();
        assert_eq!(
            indexes(&pool, &schema, name).await,
            ix_after,
            "{name}: second run"
        );
        assert_eq!(columns(&pool, &schema, name).await, cols_after);
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {target}")))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 2, "{name}: rows intact");
    }
    // The window index under another name (a user's own copy) is not added a second time.
    let t = TableName::new(&format!("{schema}.inbox_events")).unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP INDEX \"{schema}\".idx_inbox_events_pending_window; \
         CREATE INDEX my_window ON {q} (consumer_group, scheduled_at, created_at, id) \
          WHERE status COLLATE \"C\" = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let before = indexes(&pool, &schema, "inbox_events").await;
    create_inbox_schema(&pool, &t, Layout::Plain).await.unwrap();
    assert_eq!(indexes(&pool, &schema, "inbox_events").await, before);
    assert!(before.iter().any(|i| i.starts_with("my_window:")));
    sqlx::raw_sql(AssertSqlSafe(fixtures::drop_schema(&schema)))
        .execute(&pool)
        .await
        .unwrap();
}
