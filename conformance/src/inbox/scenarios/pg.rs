//! The inbox's `[pg]` scenarios (scenarios.md sections 20 to 28): a handler's broken
//! transaction (F-13, Y-03), the partitioned table's landing and sibling rules (D-03 to D-06,
//! P-04), a message the database refuses (E-14). They read and write the table with plain SQL
//! ([`InboxHarness::sql`]), so they run only on the Postgres harnesses.

use std::time::Duration;

use serde_json::json;
use txoutbox_core::event::Status;
use txoutbox_core::inbox::repository::{InboxBackend, InboxRepository, InboxTransaction};
use txoutbox_core::inbox::scripted::AckOp;
use txoutbox_core::inbox::{DeliveryOutcome as O, NewInboxEvent, OnFailure, RowReport};

use crate::inbox::ctx::{Ictx, g};
use crate::inbox::harness::{InboxFactory, InboxHarness};
use crate::inbox::script::Act;

/// The handler action `sql_error`: a statement the server refuses inside the handler's
/// transaction, which aborts it until the rollback to the savepoint.
fn sql_error() -> Act {
    Act::Sql("SELECT 1/0".into())
}

fn ev(id: &str, n: i64) -> NewInboxEvent {
    NewInboxEvent::builder()
        .message_id(id)
        .consumer_group("g")
        .source("src")
        .event_type("e")
        .payload_json(json!({"n": n}))
        .build()
        .expect("valid")
}

/// Inserts with plain SQL a pending (or `status`) row of message `id` in group g created
/// `ago_ms` milliseconds before now, as a writer around the advisory lock (or an older one)
/// would: the partitioned table can then hold two rows of one dedup key (R164).
async fn plain_row<H: InboxHarness>(c: &Ictx<H>, id: &str, status: &str, ago_ms: i64, n: i64) {
    let completed_at = if status == "completed" {
        "now()"
    } else {
        "NULL"
    };
    c.h.sql(&format!(
        "INSERT INTO {{table}} (id, event_type, payload, status, attempts_made, max_attempts, \
         scheduled_at, completed_at, created_at, updated_at, message_id, consumer_group, source) \
         VALUES (gen_random_uuid(), 'e', '{{\"n\": {n}}}'::jsonb, '{status}', 0, 6, \
         now() - INTERVAL '{ago_ms} milliseconds', {completed_at}, \
         now() - INTERVAL '{ago_ms} milliseconds', now(), '{id}', 'g', 'src')"
    ))
    .await;
}

/// F-13: a handler that breaks its transaction with an SQL error is a counted failure written
/// in T after the rollback to the savepoint; the next message runs normally (R126, R142, R181).
pub async fn f_13<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k1"));
    c.deliver("m2", Some("k2"));
    c.script("m1", vec![sql_error()]);
    c.script("m2", vec![Act::Write]);
    let r = c.runner().build().unwrap();
    let a = c.handle(&r).await;
    assert_eq!(
        (a.outcome, a.committed, a.guard_failed),
        (O::Recorded, true, false)
    );
    let row = c.row_of("m1").await;
    assert_eq!((row.status, row.attempts_made), (Status::Pending, 1));
    let err = row.last_error.unwrap_or_default();
    assert!(err.contains("division by zero"), "last_error {err:?}");
    let b = c.handle(&r).await;
    assert_eq!((b.outcome, b.committed), (O::Completed, true));
    assert_eq!(c.effects().await, vec!["m2"]);
}

/// Y-03: one row's broken transaction is its own problem; the cycle's other rows complete
/// (R152).
pub async fn y_03<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let m1 = c.land("m1", Some("k1")).await;
    let m2 = c.land("m2", Some("k2")).await;
    let m3 = c.land("m3", Some("k3")).await;
    c.script("m1", vec![sql_error()]);
    let p = c.processor().build().unwrap();
    let rep = c.cycle(&p).await;
    match rep.of(m1.id) {
        Some(RowReport::Counted { error, .. }) => {
            assert!(error.contains("division by zero"), "{error}")
        }
        other => panic!("m1: {other:?}"),
    }
    assert_eq!(rep.of(m2.id), Some(&RowReport::Completed { status: None }));
    assert_eq!(rep.of(m3.id), Some(&RowReport::Completed { status: None }));
    let r1 = c.row_of("m1").await;
    assert!(
        r1.last_error
            .unwrap_or_default()
            .contains("division by zero")
    );
    assert_eq!(r1.attempts_made, 1);
    let mut effects = c.effects().await;
    effects.sort();
    assert_eq!(effects, vec!["m2", "m3"]);
}

/// Y-16 An undecodable row fails alone (R106). Besides the scenario's headers that are not a
/// string map (k1), any column the backend cannot read counts, as for the outbox's P-08
/// (amended): a `-infinity` scheduled_at (k3), a payload number beyond f64 (k4) and, on the plain
/// table (the partitioned one has no partition for it), an `infinity` created_at (k5). Each is a
/// counted failure with last_error `undecodable row: …`, the handler not called for it,
/// released; the valid row behind k1's bad one does not run (its key's head failed); k2's valid
/// row completes.
pub async fn y_16<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let caps = c.backend().capabilities();
    assert!(caps.undecodable_rows);
    let ago = "now() - INTERVAL '1 second'";
    // (key, headers, payload, scheduled_at, created_at)
    let mut bad_rows = vec![
        ("k1", "'{\"a\": 1}'", "'{\"n\": 1}'", "now()", ago),
        ("k3", "NULL", "'{\"n\": 1}'", "'-infinity'", ago),
        ("k4", "NULL", "'{\"n\": 1e400}'", "now()", ago),
    ];
    if !caps.siblings {
        bad_rows.push(("k5", "NULL", "'{\"n\": 1}'", "now()", "'infinity'"));
    }
    let mut bad = Vec::new();
    for (key, headers, payload, scheduled, created) in bad_rows {
        let id = uuid::Uuid::new_v4();
        c.h.sql(&format!(
            "INSERT INTO {{table}} (id, event_type, payload, headers, status, attempts_made, \
             max_attempts, scheduled_at, created_at, updated_at, message_id, consumer_group, \
             source, partition_key) VALUES ('{id}', 'e', {payload}::jsonb, {headers}::jsonb, \
             'pending', 0, 6, {scheduled}, {created}, now(), 'bad-{key}', 'g', 'src', '{key}')"
        ))
        .await;
        bad.push((key, id));
    }
    let behind = c.land("m3", Some("k1")).await;
    let good = c.land("m2", Some("k2")).await;
    let p = c.processor().max_per_key(16).build().unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(
        rep.of(good.id),
        Some(&RowReport::Completed { status: None }),
        "{rep:?}"
    );
    assert!(
        matches!(rep.of(behind.id), None | Some(RowReport::Released)),
        "{rep:?}"
    );
    for (key, id) in &bad {
        match rep.of(*id) {
            Some(RowReport::Counted {
                error,
                terminal: false,
                ..
            }) if error.starts_with("undecodable row: ") => {}
            other => panic!("the bad row on {key}: {other:?}"),
        }
        let r = c
            .h
            .sql(&format!(
                "SELECT attempts_made, last_error, status, locked_by FROM {{table}} WHERE id = '{id}'"
            ))
            .await;
        let r = &r[0];
        assert_eq!(r["attempts_made"], 1, "{r}");
        assert_eq!(r["status"], "pending", "{r}");
        assert!(r["locked_by"].is_null(), "{r}");
        assert!(
            r["last_error"]
                .as_str()
                .is_some_and(|e| e.starts_with("undecodable row: ")),
            "{r}"
        );
    }
    assert_eq!(c.handler.run_ids(), vec!["m2"]);
    assert_eq!(c.effects().await, vec!["m2"]);
    let m3 = c.row_of("m3").await;
    assert_eq!(
        (m3.status, m3.attempts_made, m3.locked_by),
        (Status::Pending, 0, None)
    );
}

/// Y-23 (added by the suite): a redelivery whose stored row does not decode is not run and not
/// rewound (R106, R130). The stored row of m1 on k (written with plain SQL, headers `{"a": 1}`)
/// is pending, then, on a fresh table, completed. Under record, rewind and at_most_once the
/// delivery of m1 is `landed` (pending) or `duplicate` (completed), committed once and never
/// rewound; the handler is not called and the row keeps its state. A processor cycle then fails
/// the pending row as a counted `undecodable row: …` failure (Y-16): the row is in the inbox's
/// hands. Before the runner read R130 this way, each redelivery was `persist_failed` and
/// rewound 1 s, for ever.
pub async fn y_23<F: InboxFactory>(f: &F) {
    for status in ["pending", "completed"] {
        for policy in ["record", "rewind", "at_most_once"] {
            let c = Ictx::new(f).await;
            let id = uuid::Uuid::new_v4();
            let completed_at = if status == "completed" {
                "now()"
            } else {
                "NULL"
            };
            c.h.sql(&format!(
                "INSERT INTO {{table}} (id, event_type, payload, headers, status, attempts_made, \
                 max_attempts, scheduled_at, completed_at, created_at, updated_at, message_id, \
                 consumer_group, source, partition_key) VALUES ('{id}', 'e', '{{\"n\": 1}}'::jsonb, \
                 '{{\"a\": 1}}'::jsonb, '{status}', 0, 6, now() - INTERVAL '1 second', \
                 {completed_at}, now() - INTERVAL '1 second', now(), 'm1', 'g', 'src', 'k')"
            ))
            .await;
            let i = c.deliver("m1", Some("k"));
            c.script("m1", vec![Act::Write]);
            let mut b = c.runner();
            b = match policy {
                "record" => b.on_failure(OnFailure::Record),
                "rewind" => b.on_failure(OnFailure::Rewind),
                _ => b.at_most_once(true),
            };
            let r = b.build().unwrap();
            let res = c.handle(&r).await;
            let want = if status == "pending" {
                O::Landed
            } else {
                O::Duplicate
            };
            let ctx = format!("Y-23 {status} row, {policy}");
            assert_eq!(
                (res.outcome, res.committed, res.row_id),
                (want, true, Some(id)),
                "{ctx}: the delivery of a message whose stored row does not decode is {want:?} \
                 and committed (R106, R130): {res:?}"
            );
            assert_eq!(c.sub.acks(i), vec![AckOp::Commit], "{ctx}: never rewound");
            assert_eq!(
                c.handler.runs_of("m1"),
                0,
                "{ctx}: the handler is not called"
            );
            assert!(c.effects().await.is_empty(), "{ctx}");
            let row =
                c.h.sql(
                    "SELECT status, attempts_made, last_error, locked_by FROM {table} \
                     WHERE message_id = 'm1'",
                )
                .await;
            assert_eq!(row.len(), 1, "{ctx}: one row: {row:?}");
            let row = &row[0];
            assert_eq!(
                (&row["status"], &row["attempts_made"]),
                (&json!(status), &json!(0)),
                "{ctx}: the row keeps its state: {row}"
            );
            assert!(
                row["last_error"].is_null() && row["locked_by"].is_null(),
                "{ctx}: {row}"
            );
            if status == "pending" && policy == "record" {
                let p = c.processor().build().unwrap();
                let rep = c.cycle(&p).await;
                match rep.of(id) {
                    Some(RowReport::Counted { error, .. })
                        if error.starts_with("undecodable row: ") => {}
                    other => panic!("{ctx}: the processor fails the row alone: {other:?}"),
                }
                assert_eq!(c.handler.runs_of("m1"), 0, "{ctx}");
            }
        }
    }
}

/// D-03: the partitioned landing takes the ancestor's advisory lock, with omni-box 0.3.1's
/// arguments, and a second landing waits for it (R111).
pub async fn d_03<F: InboxFactory>(f: &F) {
    for commit in [true, false] {
        let c = Ictx::new(f).await;
        let b = c.backend();
        let mut t1 = b.begin().await.unwrap();
        let l1 = t1.land(vec![ev("m1", 1)]).await.unwrap();
        let locks = c
            .h
            .sql(
                "SELECT classid::int8 AS classid, objid::int8 AS objid, objsubid::int8 AS objsubid, \
                 (hashtext('m1')::int8 & 4294967295) AS want_class, \
                 (hashtext('g')::int8 & 4294967295) AS want_obj \
                 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2",
            )
            .await;
        assert!(
            locks
                .iter()
                .any(|l| l["classid"] == l["want_class"] && l["objid"] == l["want_obj"]),
            "no advisory lock (hashtext('m1'), hashtext('g')) granted: {locks:?}"
        );
        let mut t2 = b.begin().await.unwrap();
        let waiting = t2.land(vec![ev("m1", 2)]);
        let control = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if commit {
                t1.commit().await.unwrap();
            } else {
                t1.rollback().await;
            }
        };
        let (l2, ()) = tokio::join!(waiting, control);
        let l2 = l2.unwrap();
        t2.commit().await.unwrap();
        if commit {
            assert_eq!((l2[0].row.id, l2[0].inserted), (l1[0].row.id, false));
        } else {
            assert!(l2[0].inserted, "T1 rolled back: T2 inserts its own row");
        }
        assert_eq!(b.counts(&g()).await.unwrap()[0].count, 1);
    }
}

/// D-04: a completed sibling makes a delivery a duplicate; the landing returns the completed
/// row (R111).
pub async fn d_04<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    plain_row(&c, "m1", "pending", 2000, 1).await;
    plain_row(&c, "m1", "completed", 1000, 2).await;
    c.deliver("m1", None);
    c.script("m1", vec![Act::Write]);
    let r = c.runner().build().unwrap();
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Duplicate, true));
    assert_eq!(c.handler.runs_of("m1"), 0);
    let mut tx = c.backend().begin().await.unwrap();
    let l = tx.land(vec![ev("m1", 3)]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        (l[0].row.status, l[0].inserted, l[0].row.payload.clone()),
        (Status::Completed, false, json!({"n": 2}))
    );
}

/// D-05: lookup by message id on the partitioned table returns what a landing returns, the
/// earliest row when none is completed (R111, R112).
pub async fn d_05<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    plain_row(&c, "m1", "pending", 2000, 1).await;
    plain_row(&c, "m1", "pending", 1000, 2).await;
    let got = c.row_of("m1").await;
    assert_eq!(got.payload, json!({"n": 1}));
    let mut tx = c.backend().begin().await.unwrap();
    let l = tx.land(vec![ev("m1", 3)]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        (l[0].row.payload.clone(), l[0].inserted),
        (json!({"n": 1}), false)
    );
    let n = c.h.sql("SELECT count(*)::int8 AS n FROM {table}").await;
    assert_eq!(n[0]["n"], 2, "no row is added");
}

/// P-04 (amended): a pending row with a completed sibling is completed without a run and
/// reported as a duplicate_sibling, not left held (R164).
pub async fn p_04<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    plain_row(&c, "m1", "completed", 2000, 1).await;
    plain_row(&c, "m1", "pending", 1000, 2).await;
    let p = c.processor().build().unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(rep.outcomes.len(), 1, "{rep:?}");
    assert_eq!(
        rep.outcomes[0].1,
        RowReport::Duplicate {
            reason: "duplicate_sibling".into()
        }
    );
    assert_eq!(c.handler.runs_of("m1"), 0);
    let rows =
        c.h.sql("SELECT status, locked_at FROM {table} WHERE message_id = 'm1'")
            .await;
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(
            (r["status"].as_str(), r["locked_at"].is_null()),
            (Some("completed"), true)
        );
    }
}

/// D-06: two pending siblings in one cycle run once; the later one is a duplicate_sibling
/// (R164).
pub async fn d_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    plain_row(&c, "m1", "pending", 2000, 1).await;
    plain_row(&c, "m1", "pending", 1000, 2).await;
    c.handler.always(Act::Write);
    let p = c.processor().handler_concurrency(2).build().unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(c.handler.runs_of("m1"), 1, "{rep:?}");
    let dups = rep
        .outcomes
        .iter()
        .filter(
            |(_, r)| matches!(r, RowReport::Duplicate { reason } if reason == "duplicate_sibling"),
        )
        .count();
    assert_eq!(dups, 1, "{rep:?}");
    let rows =
        c.h.sql("SELECT status FROM {table} WHERE message_id = 'm1'")
            .await;
    assert!(rows.iter().all(|r| r["status"] == "completed"), "{rows:?}");
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// E-14: a message the database refuses (a partitioned table without a partition for now:
/// SQLSTATE 23514) is dead-lettered and terminated, every time; under at_most_once it was
/// committed before, and is copied only (R132, R139, R140). Needs a harness whose partitioned
/// table has one partition for a past month only.
pub async fn e_14<F: InboxFactory>(f: &F) {
    let prefix = "invalid message: database refused the message: 23514: ";
    for at_most_once in [false, true] {
        let c = Ictx::new(f).await;
        let i = c.deliver("m1", None);
        c.script("m1", vec![Act::Write]);
        let r = c.runner().at_most_once(at_most_once).build().unwrap();
        let res = c.handle(&r).await;
        assert_eq!(
            (res.outcome, res.invalid_label),
            (O::Invalid, Some("db_refused")),
            "at_most_once {at_most_once}: {res:?}"
        );
        let dl = c.sub.dead_letters();
        assert_eq!(dl.len(), 1, "one dead-letter copy");
        assert!(dl[0].reason.starts_with(prefix), "{}", dl[0].reason);
        if at_most_once {
            assert_eq!(c.sub.acks(i), vec![AckOp::Commit]);
        } else {
            assert_eq!(c.sub.acks(i), vec![AckOp::Term(dl[0].reason.clone())]);
            c.duplicate("m1");
            let again = c.handle(&r).await;
            assert_eq!(
                (again.outcome, again.invalid_label),
                (O::Invalid, Some("db_refused"))
            );
            assert_eq!(c.sub.dead_letters().len(), 2);
        }
        assert_eq!(c.handler.runs().len(), 0);
        assert!(c.backend().counts(&g()).await.unwrap().is_empty(), "no row");
    }
}

/// F-21: a timed-out handler's statement does not outlive the run: the server's statement
/// timeout (the handler timeout, set in the savepoint) ends it, the failure is recorded within
/// a second, and the next run reads the statement timeout as the handler timeout (R165, R181).
/// The server's statement timeout can fail the statement just before the runner's timer fires
/// (a loaded machine); `run_handler` reads a handler error that arrives at or after the timeout
/// as the timeout, so the row gets R118's text either way.
pub async fn f_21<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k1"));
    c.deliver("m2", Some("k2"));
    c.script("m1", vec![Act::Sql("SELECT pg_sleep(10)".into())]);
    // Completes only when its run reads statement_timeout = 200ms.
    c.script(
        "m2",
        vec![Act::Sql(
            "DO $$ BEGIN IF current_setting('statement_timeout') <> '200ms' THEN \
             RAISE EXCEPTION 'statement_timeout is %', current_setting('statement_timeout'); \
             END IF; END $$"
                .into(),
        )],
    );
    let r = c
        .runner()
        .handler_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let start = std::time::Instant::now();
    let a = c.handle(&r).await;
    let took = start.elapsed();
    assert_eq!((a.outcome, a.committed), (O::Recorded, true), "{a:?}");
    assert!(took < Duration::from_secs(1), "m1 took {took:?}");
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (
            Status::Pending,
            1,
            Some("Handler execution timed out after 0.2s")
        )
    );
    let sleeping =
        c.h.sql(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(10)%' \
             AND state = 'active'",
        )
        .await;
    assert!(sleeping.is_empty(), "still sleeping: {sleeping:?}");
    let b = c.handle(&r).await;
    assert_eq!((b.outcome, b.committed), (O::Completed, true), "{b:?}");
}

/// Z-04: a row landed the ancestor's way is run here, and every row this library writes keeps
/// the ancestor's invariants (R172, R174).
pub async fn z_04<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    // As omni-box 0.3.1's runner lands it: UUIDv4, application-clock created_at, scheduled_at
    // 7 µs later, headers null, no partition_key, updated_at from the column default.
    c.h.sql(
        "INSERT INTO {table} (id, event_type, payload, headers, status, attempts_made, \
         max_attempts, scheduled_at, created_at, message_id, consumer_group, source) \
         VALUES (gen_random_uuid(), 'e', '{\"n\": 1}'::jsonb, NULL, 'pending', 0, 6, \
         now() + INTERVAL '7 microseconds', now(), 'omni-1', 'g', 'omni')",
    )
    .await;
    // One row in each state, produced here.
    for (id, act) in [
        ("done", Act::Write),
        ("counted", Act::Fail("x".into())),
        ("transient", Act::Transient("y".into())),
    ] {
        c.deliver(id, Some(id));
        c.script(id, vec![act]);
    }
    let r = c.runner().build().unwrap();
    for _ in 0..3 {
        c.handle(&r).await;
    }
    c.deliver("amo", None);
    c.script("amo", vec![Act::Fail("z".into())]);
    c.handle(&c.runner().at_most_once(true).build().unwrap())
        .await;
    c.deliver("landed", Some("l"));
    c.handle(&c.bare_runner().build().unwrap()).await;
    c.land("held", Some("h")).await;
    let req = txoutbox_core::inbox::InboxFetchRequest::new(
        txoutbox_core::event::WorkerId::new("w9").unwrap(),
        g(),
        10,
    );
    let mut req = req;
    req.sources = Some(vec!["src".into()]);
    let held = c.backend().fetch_and_lock(&req).await.unwrap();
    assert!(
        held.iter()
            .any(|r| r.row().is_some_and(|r| r.message_id == "held"))
    );
    // One processor cycle over the ancestor's row.
    c.handler.always(Act::Write);
    let p = c.processor().sources(["omni"]).build().unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(rep.outcomes.len(), 1, "{rep:?}");
    assert_eq!(rep.outcomes[0].1, RowReport::Completed { status: None });
    let rows = c
        .h
        .sql(
            "SELECT message_id, status, attempts_made, max_attempts, updated_at IS NOT NULL AS updated, \
             completed_at IS NOT NULL AS completed, (locked_at IS NULL) = (locked_by IS NULL) AS lock_ok, \
             scheduled_at >= created_at - INTERVAL '60 seconds' \
               AND scheduled_at <= created_at + INTERVAL '31536000 seconds' AS sched_ok, \
             (headers IS NULL OR (jsonb_typeof(headers) = 'object' \
               AND (SELECT count(*) FROM jsonb_each(headers)) <= 100 \
               AND NOT EXISTS (SELECT 1 FROM jsonb_each(headers) e WHERE jsonb_typeof(e.value) <> 'string'))) AS headers_ok, \
             (jsonb_typeof(payload) = 'object' AND payload <> '{}'::jsonb) AS payload_ok \
             FROM {table}",
        )
        .await;
    assert_eq!(rows.len(), 7, "{rows:?}");
    for r in &rows {
        let status = r["status"].as_str().unwrap();
        assert!(["pending", "completed", "failed"].contains(&status), "{r}");
        assert_eq!(r["completed"], status == "completed", "{r}");
        assert!(
            r["attempts_made"].as_i64() <= r["max_attempts"].as_i64(),
            "{r}"
        );
        for k in ["updated", "lock_ok", "sched_ok", "headers_ok", "payload_ok"] {
            assert_eq!(r[k], true, "{k}: {r}");
        }
    }
    let omni = rows.iter().find(|r| r["message_id"] == "omni-1").unwrap();
    assert_eq!(omni["status"], "completed");
    let amo = rows.iter().find(|r| r["message_id"] == "amo").unwrap();
    assert_eq!(amo["status"], "failed");
}

/// E-18: a landing the database refuses with a data exception (SQLSTATE class 22: a trigger of
/// the table casts message_id to numeric, `invalid input syntax for type numeric`, 22P02) is
/// dead-lettered and terminated as E-14's class 23 is, on every driver, and never rewound as a
/// persistence error; a message the trigger lets through lands and runs (R132, R139, R140).
pub async fn e_18<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.h.sql(
        "CREATE FUNCTION {schema}.e18_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.message_id = 'm1' THEN PERFORM NEW.message_id::numeric; END IF; \
         RETURN NEW; END $$",
    )
    .await;
    c.h.sql(
        "CREATE TRIGGER e18_refuse BEFORE INSERT ON {table} \
         FOR EACH ROW EXECUTE FUNCTION {schema}.e18_refuse()",
    )
    .await;
    let i = c.deliver("m1", Some("k1"));
    c.script("m1", vec![Act::Write]);
    let r = c.runner().build().unwrap();
    let res = c.handle(&r).await;
    assert_eq!(
        (res.outcome, res.invalid_label),
        (O::Invalid, Some("db_refused")),
        "{res:?}"
    );
    let dl = c.sub.dead_letters();
    assert_eq!(dl.len(), 1, "one dead-letter copy");
    let prefix = "invalid message: database refused the message: 22P02: ";
    assert!(dl[0].reason.starts_with(prefix), "{}", dl[0].reason);
    assert!(dl[0].reason.contains("numeric"), "{}", dl[0].reason);
    assert_eq!(c.sub.acks(i), vec![AckOp::Term(dl[0].reason.clone())]);
    assert_eq!(c.handler.runs().len(), 0);
    c.deliver("m2", Some("k1"));
    c.script("m2", vec![Act::Write]);
    let res = c.handle(&r).await;
    assert_eq!(res.outcome, O::Completed, "{res:?}");
    assert_eq!(c.effects().await, vec!["m2"]);
    assert_eq!(c.count_rows(&["m1", "m2"]).await, 1);
}
