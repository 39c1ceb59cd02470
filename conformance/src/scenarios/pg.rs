//! PG: Postgres backends and P-08 (an undecodable row fails alone).
//!
//! These run through [`Harness::sql`](crate::Harness::sql) (plain SQL on the trial's table,
//! `{table}` being the quoted qualified table name) and
//! [`Harness::create_schema_for`](crate::Harness::create_schema_for) (the backend's own schema
//! creation for another table name). Postgres harnesses run their sessions with
//! `TimeZone = 'America/New_York'` (PG-09 checks that precondition).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use txoutbox_core::clock::ManualClock;
use txoutbox_core::event::{BuildSettings, NewEvent, Status, WorkerId};
use txoutbox_core::repository::{Outcome, OutcomeKind, OutcomeResult};
use txoutbox_core::scripted::{Action, Gate};
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx};
use crate::harness::Factory;

/// The ancestor's DDL exactly as the ancestor library created it (R78), for table `outbox_events`.
pub const ANCESTOR_DDL: &str = r#"CREATE TABLE outbox_events (
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
    CONSTRAINT outbox_events_pkey PRIMARY KEY (id),
    CONSTRAINT ck_outbox_events_attempts_valid
        CHECK (attempts_made <= max_attempts),
    CONSTRAINT ck_outbox_events_completed_status_consistency
        CHECK ((status = 'completed' AND completed_at IS NOT NULL)
            OR (status <> 'completed' AND completed_at IS NULL)),
    CONSTRAINT ck_outbox_events_lock_consistency
        CHECK ((locked_at IS NULL AND locked_by IS NULL)
            OR (locked_at IS NOT NULL AND locked_by IS NOT NULL))
);

CREATE INDEX idx_outbox_events_completed_cleanup ON outbox_events (completed_at)
    WHERE status = 'completed' AND completed_at IS NOT NULL;
CREATE INDEX idx_outbox_events_created_at ON outbox_events (created_at);
CREATE UNIQUE INDEX idx_outbox_events_idempotency_key ON outbox_events (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX idx_outbox_events_locked_at ON outbox_events (locked_at)
    WHERE locked_at IS NOT NULL;
CREATE INDEX idx_outbox_events_pending_fetch ON outbox_events (scheduled_at)
    WHERE status = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts;
CREATE INDEX idx_outbox_events_pending_key_order ON outbox_events (topic, partition_key, created_at)
    WHERE status = 'pending';
CREATE INDEX idx_outbox_events_updated_at ON outbox_events (updated_at);
"#;

/// The additions to Appendix A that the Postgres backends create (contract Appendix A
/// "Additions", R78), for table `outbox_events`, written out here as the scenarios' reference:
/// the fetch window's index, ordered as the window's `ORDER BY`, and the parked rows' index
/// (R193).
pub const ADDITIONS_DDL: &str = r#"CREATE INDEX idx_outbox_events_pending_window ON outbox_events (scheduled_at, created_at, id)
    WHERE status COLLATE "C" = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts;
CREATE INDEX idx_outbox_events_parked ON outbox_events (created_at, id)
    WHERE status = 'pending' AND attempts_made >= max_attempts;
"#;

/// The Appendix A DDL for `schema.table`: every `outbox_events` replaced by `table`, and the
/// table itself qualified by `schema`.
pub fn ancestor_ddl(schema: &str, table: &str) -> String {
    qualify(ANCESTOR_DDL, schema, table)
}

/// [`ADDITIONS_DDL`] for `schema.table`, like [`ancestor_ddl`].
pub fn additions_ddl(schema: &str, table: &str) -> String {
    qualify(ADDITIONS_DDL, schema, table)
}

fn qualify(ddl: &str, schema: &str, table: &str) -> String {
    ddl.replace(
        " ON outbox_events ",
        &format!(" ON \"{schema}\".outbox_events "),
    )
    .replace(
        "CREATE TABLE outbox_events",
        &format!("CREATE TABLE \"{schema}\".outbox_events"),
    )
    .replace("outbox_events", table)
}

fn peer(cfg: Cfg) -> Cfg {
    Cfg { peer: true, ..cfg }
}

pub(crate) async fn sql(c: &Ctx, statement: &str) -> Vec<Value> {
    c.h.sql(statement)
        .await
        .unwrap_or_else(|e| panic!("SQL failed: {e}\n{statement}"))
}

pub(crate) async fn one(c: &Ctx, statement: &str) -> Value {
    let mut v = sql(c, statement).await;
    assert_eq!(v.len(), 1, "expected one row from {statement}");
    v.remove(0)
}

/// The trial table's schema and bare name.
async fn names(c: &Ctx) -> (String, String) {
    let r = one(
        c,
        "SELECT n.nspname AS s, t.relname AS t FROM pg_class t JOIN pg_namespace n ON n.oid = t.relnamespace \
         WHERE t.oid = '{table}'::regclass",
    )
    .await;
    (
        r["s"].as_str().unwrap().to_owned(),
        r["t"].as_str().unwrap().to_owned(),
    )
}

/// A catalog description of a table with its name replaced by `<t>`: columns (name, type, not
/// null, default), constraints (name, definition) and indexes (name, definition), each sorted.
async fn describe(c: &Ctx, schema: &str, table: &str) -> Value {
    let rel = format!("'\"{schema}\".\"{table}\"'::regclass");
    let cols = sql(
        c,
        &format!(
            "SELECT a.attnum AS n, a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type, \
             a.attnotnull AS not_null, pg_get_expr(d.adbin, d.adrelid) AS def \
             FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
             WHERE a.attrelid = {rel} AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum"
        ),
    )
    .await;
    let cons = sql(
        c,
        &format!(
            "SELECT conname AS name, contype::text AS kind, pg_get_constraintdef(oid) AS def \
             FROM pg_constraint WHERE conrelid = {rel} ORDER BY conname"
        ),
    )
    .await;
    let idx = sql(
        c,
        &format!(
            "SELECT i.relname AS name, ix.indisunique AS uniq, pg_get_indexdef(ix.indexrelid) AS def \
             FROM pg_index ix JOIN pg_class i ON i.oid = ix.indexrelid \
             WHERE ix.indrelid = {rel} ORDER BY i.relname"
        ),
    )
    .await;
    let text = json!({ "columns": cols, "constraints": cons, "indexes": idx }).to_string();
    let text = text
        .replace(&format!("{schema}."), "<s>.")
        .replace(table, "<t>");
    let mut v: Value = serde_json::from_str(&text).expect("json");
    for k in ["constraints", "indexes"] {
        v[k].as_array_mut()
            .unwrap()
            .sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    }
    v
}

/// PG-01 The key-order index exists.
pub async fn pg_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (_, t) = names(&c).await;
    let r = sql(
        &c,
        "SELECT i.relname AS name, pg_get_indexdef(ix.indexrelid) AS def, \
         pg_get_expr(ix.indpred, ix.indrelid) AS pred \
         FROM pg_index ix JOIN pg_class i ON i.oid = ix.indexrelid WHERE ix.indrelid = '{table}'::regclass",
    )
    .await;
    let name = format!("idx_{t}_pending_key_order");
    let ix = r
        .iter()
        .find(|r| r["name"] == name.as_str())
        .unwrap_or_else(|| panic!("no index {name}: {r:?}"));
    let def = ix["def"].as_str().unwrap();
    assert!(
        def.contains("USING btree (topic, partition_key, created_at)"),
        "{def}"
    );
    assert_eq!(ix["pred"], "((status)::text = 'pending'::text)");
}

/// PG-02 The table matches the ancestor's.
pub async fn pg_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (s, t) = names(&c).await;
    let anc = "anc_events";
    sql(&c, &ancestor_ddl(&s, anc)).await;
    sql(&c, &additions_ddl(&s, anc)).await;
    let ours = describe(&c, &s, &t).await;
    let theirs = describe(&c, &s, anc).await;
    assert_eq!(ours["columns"], theirs["columns"]);
    assert_eq!(ours["constraints"], theirs["constraints"]);
    assert_eq!(ours["indexes"], theirs["indexes"]);
    assert_eq!(ours["columns"].as_array().unwrap().len(), 23);
    assert_eq!(ours["constraints"].as_array().unwrap().len(), 4);
    assert_eq!(
        ours["indexes"].as_array().unwrap().len(),
        10,
        "seven indexes, the two additions and the primary key"
    );
}

/// PG-03 Table name validation.
pub async fn pg_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (s, _) = names(&c).await;
    let long31 = format!("t{}", "x".repeat(30));
    let long32 = format!("t{}", "x".repeat(31));
    let cases: Vec<(String, bool)> = vec![
        ("outbox_events".into(), true),
        (format!("{s}.outbox_events"), true),
        ("Outbox".into(), false),
        ("a-b".into(), false),
        (format!("{s}.{long31}"), true),
        (long32.clone(), false),
    ];
    for (name, ok) in &cases {
        // A bare accepted name would land in the connection's default schema; qualify those.
        let name = if *ok && !name.contains('.') {
            format!("{s}.{name}_b")
        } else {
            name.clone()
        };
        let r =
            c.h.create_schema_for(&name)
                .await
                .expect("the backend configures table names");
        assert_eq!(r.is_ok(), *ok, "{name}: {r:?}");
    }
    let d = describe(&c, &s, &long31).await;
    let mut stored: Vec<String> = Vec::new();
    for k in ["constraints", "indexes"] {
        for x in d[k].as_array().unwrap() {
            stored.push(x["name"].as_str().unwrap().replace("<t>", &long31));
        }
    }
    for want in [
        format!("{long31}_pkey"),
        format!("ck_{long31}_attempts_valid"),
        format!("ck_{long31}_completed_status_consistency"),
        format!("ck_{long31}_lock_consistency"),
        format!("idx_{long31}_completed_cleanup"),
        format!("idx_{long31}_created_at"),
        format!("idx_{long31}_idempotency_key"),
        format!("idx_{long31}_locked_at"),
        format!("idx_{long31}_pending_fetch"),
        format!("idx_{long31}_pending_key_order"),
        format!("idx_{long31}_pending_window"),
        format!("idx_{long31}_parked"),
        format!("idx_{long31}_updated_at"),
    ] {
        assert!(
            stored.contains(&want),
            "{want} not stored unshortened: {stored:?}"
        );
    }
}

/// The invariants of R3 on every row, read with plain SQL; returns the number of rows.
async fn assert_invariants(c: &Ctx) -> usize {
    let rows = sql(
        c,
        "SELECT id, status, attempts_made, max_attempts, \
           (locked_at IS NULL) = (locked_by IS NULL) AS lock_ok, \
           ((status = 'completed') = (completed_at IS NOT NULL)) AS completion_ok, \
           (completed_at IS NULL OR (completed_at >= created_at - interval '1 second' \
              AND completed_at >= scheduled_at - interval '1 second')) AS completed_time_ok, \
           updated_at IS NOT NULL AS updated_ok, \
           last_error IS NOT NULL AS has_error, \
           scheduled_at BETWEEN created_at - interval '60 seconds' AND created_at + interval '31536000 seconds' AS window_ok \
         FROM {table}",
    )
    .await;
    for r in &rows {
        let st = r["status"].as_str().unwrap();
        assert!(["pending", "completed", "failed"].contains(&st), "{r}");
        let (a, m) = (
            r["attempts_made"].as_i64().unwrap(),
            r["max_attempts"].as_i64().unwrap(),
        );
        assert!(a >= 0 && m >= 1 && a <= m, "{r}");
        if st == "pending" {
            // R3 (added to by R191): a parked row is pending with every attempt spent and its
            // last_error set.
            assert!(a < m || (a == m && r["has_error"] == true), "{r}");
        }
        if st == "failed" {
            assert_eq!(a, m, "{r}");
        }
        for k in [
            "lock_ok",
            "completion_ok",
            "completed_time_ok",
            "updated_ok",
            "window_ok",
        ] {
            assert_eq!(r[k], true, "{k}: {r}");
        }
    }
    rows.len()
}

/// PG-04 Rows written the ancestor's way are relayed.
pub async fn pg_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (v1, v2) = (Uuid::new_v4(), Uuid::new_v4());
    let app_now = chrono::Utc::now();
    for (id, at) in [(v1, app_now - chrono::Duration::seconds(1)), (v2, app_now)] {
        sql(
            &c,
            &format!(
                "INSERT INTO {{table}} (id, event_type, payload, headers, status, attempts_made, max_attempts, \
                 scheduled_at, created_at, aggregate_type, aggregate_id, topic, partition_key) \
                 VALUES ('{id}', 'ancestor.event', '{{\"n\": 1}}', NULL, 'pending', 0, 6, \
                 '{at}', '{at}', 'agg', '{agg}', 't', 'k') RETURNING id",
                at = at.to_rfc3339(),
                agg = Uuid::new_v4()
            ),
        )
        .await;
    }
    assert_eq!(c.cycle1().await.sent, vec![v1]);
    assert_eq!(c.cycle1().await.sent, vec![v2]);
    c.assert_state(v1, Status::Completed, 0).await;
    c.assert_state(v2, Status::Completed, 0).await;
    assert_eq!(assert_invariants(&c).await, 2);
}

/// PG-05 Rows written here satisfy the ancestor's checks.
pub async fn pg_05(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    // completed
    c.put(c.ev("ok")).await;
    c.cycle1().await;
    // counted failure
    let r = c.put(c.ev("rej")).await;
    c.broker.script(r, [Action::Reject("bad".into())]);
    c.cycle1().await;
    // transient failure, and a deferral of the second of two rows on two keys
    let tr = c.put(c.ev("tr")).await;
    let df = c.put(c.ev("df")).await;
    c.broker.script(tr, [Action::Transient("down".into())]);
    let cy = c.cycle1().await;
    assert!(
        cy.report.deferred.iter().any(|d| d.id == df),
        "{:?}",
        cy.report
    );
    // failed
    let fl = c.put(c.ev("fail").max_attempts(1)).await;
    c.broker.script(fl, [Action::Reject("bad".into())]);
    c.cycle1().await;
    c.assert_state(fl, Status::Failed, 1).await;
    // released: the shutdown signal is set after the first publish
    let a = c.put(c.ev("rel1")).await;
    let b = c.put(c.ev("rel2")).await;
    let token = c.shutdown.clone();
    c.broker.on_ack(move |m| {
        if m.event_id == a {
            token.cancel();
        }
    });
    let cy = c.cycle1().await;
    assert!(cy.report.released.contains(&b), "{:?}", cy.report);
    assert_eq!(assert_invariants(&c).await, 7);
}

/// PG-06 The two Postgres backends share one table.
pub async fn pg_06(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    // Write with the primary, relay with the peer; then the reverse.
    let a = c.put(c.ev("k")).await;
    let cy = c.cycle(&peer(Cfg::default())).await;
    assert_eq!(cy.sent, vec![a]);
    let mut tx = c.h.begin_peer().await;
    let b = tx
        .write(vec![c.ev("k").build().unwrap()])
        .await
        .expect("peer write")[0]
        .event
        .id;
    tx.commit().await.expect("commit");
    assert_eq!(c.cycle1().await.sent, vec![b]);
    // O-07 and O-08 across backends: W1 (primary) holds k1's head, W2 (peer) gets only other
    // keys until the lease expires, then reclaims the head in order; W1's late outcome is lost.
    let e = c.puts(&["k1", "k1", "k2"]).await;
    let held = c.fetch("w1", 1, 1).await;
    assert_eq!(held, vec![e[0]]);
    let w2 = peer(Cfg::default().worker("w2"));
    let cy = c.cycle(&w2).await;
    assert_eq!(cy.sent, vec![e[2]]);
    c.advance(Duration::from_secs(299)).await;
    assert!(c.cycle(&w2).await.report.fetched.is_empty());
    c.advance(Duration::from_secs(2)).await;
    let cy = c.cycle(&w2).await;
    assert_eq!(cy.report.fetched, vec![e[0]]);
    assert_eq!(cy.sent, vec![e[0]]);
    let late = c
        .repo()
        .write_outcomes(
            &txoutbox_core::WorkerId::new("w1").unwrap(),
            &[txoutbox_core::repository::Outcome {
                id: e[0],
                kind: txoutbox_core::repository::OutcomeKind::Completed,
            }],
        )
        .await
        .unwrap();
    assert_eq!(
        late[0].result,
        txoutbox_core::repository::OutcomeResult::LeaseLost
    );
    assert_eq!(c.cycle1().await.sent, vec![e[1]]);
    // O-02 across backends: a counted failure by W1 holds its key for W2.
    let e = c.puts(&["m", "m", "o"]).await;
    c.broker.script(e[0], [Action::Reject("bad".into())]);
    let cy = c.cycle(&Cfg::default().batch(1)).await;
    assert!(cy.sent.is_empty());
    assert_eq!(c.get(e[0]).await.attempts_made, 1);
    let cy = c.cycle(&peer(Cfg::default().worker("w2"))).await;
    assert_eq!(cy.sent, vec![e[2]]);
    assert_eq!(c.get(e[1]).await.status, Status::Pending);
    assert!(c.get(e[1]).await.locked_at.is_none());
}

/// PG-07 Only the database clock counts.
pub async fn pg_07(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ahead = ManualClock::starting_now();
    ahead.advance(Duration::from_secs(3600));
    let settings = BuildSettings::new().with_clock(Arc::new(ahead));
    let a: NewEvent = c
        .ev("a")
        .delay(Duration::from_secs(600))
        .build_with(&settings)
        .unwrap();
    let b: NewEvent = c.ev("b").build_with(&settings).unwrap();
    let (a_id, b_id) = (a.id(), b.id());
    c.write(vec![a]).await;
    let before = c.now().await;
    c.write(vec![b]).await;
    let after = c.now().await;
    let (a, b) = (a_id, b_id);
    let row = c.get(b).await;
    assert!(
        row.created_at >= before - chrono::Duration::seconds(1),
        "{} vs {before}",
        row.created_at
    );
    assert!(
        row.created_at <= after + chrono::Duration::seconds(1),
        "{} vs {after}",
        row.created_at
    );
    c.broker.script(b, [Action::Reject("no".into())]);
    let cy = c.cycle1().await;
    assert!(
        !cy.report.fetched.contains(&a),
        "the delayed row was fetched"
    );
    let r = c.get(b).await;
    assert_eq!(r.attempts_made, 1);
    c.assert_next_try_within(&cy, r.scheduled_at, 5.0, 10.0);
}

/// PG-08 No transaction and no row lock during a publish.
pub async fn pg_08(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let id = c.put(c.ev("k")).await;
    let gate = Gate::new();
    c.broker.script(id, [Action::Gate(gate.clone())]);
    let relay = c.relay(&Cfg::default());
    let probe = async {
        c.broker
            .wait_for_calls(|calls| calls.iter().any(|x| x.event_id == id))
            .await;
        let locked =
            c.h.sql(&format!(
                "SELECT id FROM {{table}} WHERE id = '{id}' FOR UPDATE NOWAIT"
            ))
            .await;
        let idle = sql(
            &c,
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid() \
               AND position('{table}' in query) > 0",
        )
        .await;
        gate.open();
        (locked, idle)
    };
    let (cy, (locked, idle)) = tokio::join!(c.run(&relay), probe);
    assert!(
        locked.is_ok(),
        "the row was row-locked during the publish: {locked:?}"
    );
    assert_eq!(
        idle[0]["n"], 0,
        "a relay connection was idle in transaction during the publish"
    );
    assert_eq!(cy.sent, vec![id]);
    c.assert_state(id, Status::Completed, 0).await;
}

/// PG-09 The column default's time zone trap.
pub async fn pg_09(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let tz = one(&c, "SELECT current_setting('TimeZone') AS tz").await;
    assert_eq!(
        tz["tz"], "America/New_York",
        "Postgres harnesses run their sessions in New York"
    );
    let id = c.put(c.ev("k")).await;
    let r = one(
        &c,
        &format!(
            "SELECT abs(extract(epoch FROM created_at - now())) AS dc, \
                    abs(extract(epoch FROM updated_at - now())) AS du FROM {{table}} WHERE id = '{id}'"
        ),
    )
    .await;
    assert!(r["dc"].as_f64().unwrap() < 1.0, "{r}");
    assert!(r["du"].as_f64().unwrap() < 1.0, "{r}");
    // The trap itself: the column default in this session is off by the zone offset.
    let trap = one(
        &c,
        "INSERT INTO {table} (id, event_type, payload, status, attempts_made, max_attempts, \
           scheduled_at, aggregate_type, aggregate_id, topic, partition_key) \
           VALUES (gen_random_uuid(), 'x', '{\"n\": 1}', 'failed', 1, 1, now(), 'agg', gen_random_uuid(), 'trap', 'k') \
           RETURNING abs(extract(epoch FROM created_at - now())) AS d",
    )
    .await;
    assert!(
        trap["d"].as_f64().unwrap() >= 3600.0,
        "the default was not off: {trap}"
    );
}

/// PG-10 Creating the schema on an existing ancestor table.
pub async fn pg_10(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (s, _) = names(&c).await;
    let anc = "anc_events";
    let ddl = ancestor_ddl(&s, anc);
    let ddl: String = ddl
        .split(';')
        .filter(|st| !st.contains("_pending_key_order"))
        .collect::<Vec<_>>()
        .join(";");
    sql(&c, &ddl).await;
    let q = format!("\"{s}\".\"{anc}\"");
    for n in 0..2 {
        sql(
            &c,
            &format!(
                "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, scheduled_at, \
                 created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) VALUES \
                 (gen_random_uuid(), 'x', '{{\"n\": {n}}}', 'pending', 0, 6, now(), now(), now(), 'agg', \
                 gen_random_uuid(), 't', 'k') RETURNING id"
            ),
        )
        .await;
    }
    let rows_before = sql(&c, &format!("SELECT * FROM {q} ORDER BY id")).await;
    let before = describe(&c, &s, anc).await;
    assert_eq!(before["indexes"].as_array().unwrap().len(), 7);
    c.h.create_schema_for(&format!("{s}.{anc}"))
        .await
        .expect("supported")
        .expect("first run");
    let first = describe(&c, &s, anc).await;
    c.h.create_schema_for(&format!("{s}.{anc}"))
        .await
        .expect("supported")
        .expect("second run");
    let second = describe(&c, &s, anc).await;
    assert_eq!(first["columns"], before["columns"]);
    assert_eq!(first["constraints"], before["constraints"]);
    let added: Vec<&Value> = first["indexes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| !before["indexes"].as_array().unwrap().contains(i))
        .collect();
    let names: Vec<&str> = added.iter().map(|i| i["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "idx_<t>_parked",
            "idx_<t>_pending_key_order",
            "idx_<t>_pending_window"
        ],
        "the missing key-order index and the additions: {added:?}"
    );
    assert_eq!(second, first);
    assert_eq!(
        sql(&c, &format!("SELECT * FROM {q} ORDER BY id")).await,
        rows_before
    );
}

/// Inserts `n` due rows with plain SQL: row g on key `key_expr` (SQL over g), created_at =
/// now() − `ago` + g ms, scheduled_at = created_at.
pub(crate) async fn bulk(c: &Ctx, n: u32, key_expr: &str, ago: &str) {
    sql(
        c,
        &format!(
            "INSERT INTO {{table}} (id, event_type, payload, status, attempts_made, max_attempts, \
             scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
             SELECT gen_random_uuid(), 'bulk', '{{\"n\": 1}}', 'pending', 0, 6, ts, ts, ts, 'agg', \
                    gen_random_uuid(), 'bulk', {key_expr} \
               FROM generate_series(1, {n}) g, \
                    LATERAL (SELECT now() - interval '{ago}' + g * interval '1 millisecond' AS ts) x"
        ),
    )
    .await;
}

/// Completes `ids`, held by `worker`, in one outcome write.
async fn complete(c: &Ctx, worker: &str, ids: &[Uuid]) {
    let outcomes: Vec<Outcome> = ids
        .iter()
        .map(|id| Outcome {
            id: *id,
            kind: OutcomeKind::Completed,
        })
        .collect();
    let w = WorkerId::new(worker).expect("worker");
    let written = c
        .repo()
        .write_outcomes(&w, &outcomes)
        .await
        .expect("outcomes");
    assert!(
        written
            .iter()
            .all(|o| matches!(o.result, OutcomeResult::Applied { .. })),
        "every completion applied"
    );
}

/// PG-11 A fetch claims what it returns, whatever the backlog.
pub async fn pg_11(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    // Key s: its head waits for a retry an hour later, 200 due rows behind it, all older
    // than the 20,000 one-row keys.
    sql(
        &c,
        "INSERT INTO {table} (id, event_type, payload, status, attempts_made, max_attempts, last_error, \
         scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
         VALUES (gen_random_uuid(), 'bulk', '{\"n\": 0}', 'pending', 1, 6, 'broker said no', \
                 now() + interval '1 hour', now() - interval '3 hours', now(), 'agg', \
                 gen_random_uuid(), 'bulk', 's')",
    )
    .await;
    bulk(&c, 200, "'s'", "2 hours").await;
    bulk(&c, 20_000, "'k' || g", "1 hour").await;
    sql(&c, "ANALYZE {table}").await;
    let s_ids: std::collections::HashSet<Uuid> = sql(
        &c,
        "SELECT id::text AS id FROM {table} WHERE partition_key = 's'",
    )
    .await
    .iter()
    .map(|r| r["id"].as_str().unwrap().parse().unwrap())
    .collect();
    assert_eq!(s_ids.len(), 201);
    let mut sizes = Vec::new();
    loop {
        let got = c.fetch("w1", 100, 16).await;
        if got.is_empty() {
            break;
        }
        assert!(
            got.iter().all(|id| !s_ids.contains(id)),
            "fetch {} returned a row of the blocked key",
            sizes.len() + 1
        );
        sizes.push(got.len());
        complete(&c, "w1", &got).await;
        assert!(sizes.len() <= 200, "more than 200 fetches: {sizes:?}");
    }
    assert_eq!(sizes.len(), 200, "fetches: {sizes:?}");
    assert!(
        sizes.iter().all(|n| *n == 100),
        "each fetch returns 100: {sizes:?}"
    );
    let left = one(
        &c,
        "SELECT count(*) FILTER (WHERE status = 'pending') AS pending, \
                count(*) FILTER (WHERE status = 'completed') AS completed FROM {table}",
    )
    .await;
    assert_eq!(left["pending"], 201, "only s's rows remain: {left}");
    assert_eq!(left["completed"], 20_000, "{left}");
}

/// PG-12 Concurrent relays take different keys.
pub async fn pg_12(f: &dyn Factory) {
    let c = Arc::new(Ctx::new(f).await);
    // 2,000 keys × 5 due rows, written round robin (row g on key g mod 2000).
    bulk(&c, 10_000, "'k' || (g % 2000)", "1 hour").await;
    sql(&c, "ANALYZE {table}").await;
    let order: Arc<std::sync::Mutex<Vec<Uuid>>> = Arc::default();
    let mut relays = Vec::new();
    for r in 0..4 {
        let (c, order) = (c.clone(), order.clone());
        relays.push(tokio::spawn(async move {
            let worker = format!("relay-{r}");
            let (mut fetches, mut empty_while_due) = (0usize, 0usize);
            loop {
                let got = c.fetch(&worker, 100, 16).await;
                fetches += 1;
                if got.is_empty() {
                    let left = one(
                        &c,
                        "SELECT count(*) FILTER (WHERE status = 'pending' AND locked_at IS NULL) AS free, \
                                count(*) FILTER (WHERE status = 'pending') AS pending FROM {table}",
                    )
                    .await;
                    if left["pending"] == 0 {
                        break;
                    }
                    if left["free"].as_i64().unwrap() > 0 {
                        empty_while_due += 1;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                order.lock().unwrap().extend(&got);
                complete(&c, &worker, &got).await;
            }
            (fetches, empty_while_due)
        }));
    }
    let (mut fetches, mut empty) = (0, 0);
    for r in relays {
        let (f, e) = r.await.expect("relay task");
        fetches += f;
        empty += e;
    }
    let done = one(
        &c,
        "SELECT count(*) FILTER (WHERE status = 'completed') AS completed, count(*) AS total FROM {table}",
    )
    .await;
    assert_eq!(done["completed"], 10_000, "{done}");
    assert_eq!(done["total"], 10_000, "{done}");
    // Every row fetched once, each key in write order.
    let order = order.lock().unwrap().clone();
    assert_eq!(order.len(), 10_000, "each row fetched exactly once");
    let written = sql(
        &c,
        "SELECT id::text AS id, partition_key AS k FROM {table} ORDER BY created_at, id",
    )
    .await;
    let pos: std::collections::HashMap<Uuid, usize> =
        order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut last: std::collections::HashMap<String, usize> = Default::default();
    for r in &written {
        let id: Uuid = r["id"].as_str().unwrap().parse().unwrap();
        let k = r["k"].as_str().unwrap().to_owned();
        let p = pos[&id];
        if let Some(prev) = last.insert(k.clone(), p) {
            assert!(prev < p, "key {k} fetched out of write order");
        }
    }
    assert!(
        empty * 20 <= fetches,
        "{empty} of {fetches} fetches returned nothing while due rows remained (at most 5 %)"
    );
    eprintln!("PG-12: {fetches} fetches, {empty} empty while due rows remained");
}

/// P-08 An undecodable row fails alone. Besides the scenario's headers that are not a string
/// map, any column the backend cannot decode counts (R82): an `infinity` created_at, a
/// `-infinity` scheduled_at (both beyond chrono's range). Each such row, on a key of its own, is a
/// counted failure with last_error `undecodable row: …`, never published, released; the good
/// row of the same fetch is published.
pub async fn p_08(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    // (key, headers, scheduled_at, created_at)
    let bad_rows = [
        ("k1", "'{\"a\": 1}'", "now()", "now()"),
        ("k3", "NULL", "now()", "'infinity'"),
        ("k4", "NULL", "'-infinity'", "now()"),
    ];
    let mut bad = Vec::new();
    for (key, headers, scheduled, created) in bad_rows {
        let id = Uuid::new_v4();
        sql(
            &c,
            &format!(
                "INSERT INTO {{table}} (id, event_type, payload, headers, status, attempts_made, max_attempts, \
                 scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) VALUES \
                 ('{id}', 'x', '{{\"n\": 1}}', {headers}, 'pending', 0, 6, {scheduled}, {created}, now(), 'agg', \
                 gen_random_uuid(), 't', '{key}') RETURNING id"
            ),
        )
        .await;
        bad.push(id);
    }
    let good = c.put(c.ev("k2")).await;
    let cy = c.cycle1().await;
    assert_eq!(cy.sent, vec![good], "bad rows: {bad:?}");
    c.assert_state(good, Status::Completed, 0).await;
    let counted: Vec<Uuid> = cy.report.counted.iter().map(|f| f.id).collect();
    for id in &bad {
        assert!(
            !c.broker.called_ids().contains(id),
            "the undecodable row {id} was published"
        );
        assert!(counted.contains(id), "{id} not counted: {:?}", cy.report);
        let r = one(
            &c,
            &format!(
                "SELECT attempts_made, last_error, status, locked_by FROM {{table}} WHERE id = '{id}'"
            ),
        )
        .await;
        assert_eq!(r["attempts_made"], 1, "{r}");
        assert_eq!(r["status"], "pending", "{r}");
        assert!(r["locked_by"].is_null(), "{r}");
        assert!(
            r["last_error"]
                .as_str()
                .unwrap()
                .starts_with("undecodable row: "),
            "{r}"
        );
    }
}
