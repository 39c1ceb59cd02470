//! OP-10 (operations.md, R198): every inbox command of `outbox-relay` (`outbox-relay inbox …`)
//! against a real inbox table in a fresh schema, on both stores (sqlx on the plain layout,
//! diesel on the partitioned one), with `--json`, the outbox commands' exit codes, and the rows
//! changed as the command says (or not at all when it is refused). The rows are landed and put
//! in their states through the library's inbox (`txoutbox_postgres::SqlxInbox`); only the
//! clock-dependent columns (an old lock, an old completion) are moved back with SQL.
//!
//! Not here (they need R191/R192): parked keys, redrive, discard.

mod common;

use common::{Db, relay};
use serde_json::Value;
use txoutbox_core::WorkerId;
use txoutbox_core::inbox::repository::{
    InboxBackend, InboxFetchRequest, InboxRepository, InboxTransaction, RowLock, RowWrite,
};
use txoutbox_core::inbox::{ConsumerGroup, NewInboxEvent};
use txoutbox_core::repository::{OnExhausted, Retry};
use txoutbox_postgres::{Layout, SqlxInbox, TableName, create_inbox_schema};
use uuid::Uuid;

/// A fresh schema with an inbox table in `layout` (the partitioned one with a DEFAULT
/// partition), `db.table` naming it, and the library's sqlx inbox on it.
async fn inbox_table(layout: Layout) -> (Db, SqlxInbox) {
    let mut db = Db::fresh().await;
    let name = match layout {
        Layout::Plain => "inbox_events",
        Layout::Partitioned => "inbox_events_partitioned",
    };
    db.table = TableName::new(&format!("{}.{name}", db.schema)).expect("table");
    create_inbox_schema(&db.pool, &db.table, layout)
        .await
        .expect("create_inbox_schema");
    if layout == Layout::Partitioned {
        db.exec(&format!(
            "CREATE TABLE \"{}\".inbox_default PARTITION OF {{t}} DEFAULT",
            db.schema
        ))
        .await;
    }
    let inbox = SqlxInbox::sqlx(db.pool.clone(), &db.table, layout);
    (db, inbox)
}

/// Lands one message of `group` and source `orders` on `key`; returns the row id.
async fn land(inbox: &SqlxInbox, group: &str, key: &str, n: u32) -> Uuid {
    let ev = NewInboxEvent::builder()
        .message_id(format!("{group}-{key}-{n}"))
        .consumer_group(group)
        .source("orders")
        .event_type("order.placed")
        .partition_key(key)
        .payload_json(serde_json::json!({ "key": key, "n": n }))
        .max_attempts(3)
        .build()
        .expect("message");
    let mut tx = inbox.begin().await.expect("begin");
    let landed = tx.land(vec![ev]).await.expect("land");
    tx.commit().await.expect("commit");
    assert!(landed[0].inserted);
    landed[0].row.id
}

/// Writes `w` to the row in a transaction of its own, as the processor does.
async fn write(inbox: &SqlxInbox, id: Uuid, w: RowWrite) {
    let mut tx = inbox.begin().await.expect("begin");
    assert!(matches!(
        tx.lock_row(id).await.expect("lock"),
        RowLock::Locked(_)
    ));
    tx.write(id, w).await.expect("write");
    tx.commit().await.expect("commit");
}

/// Fetches the group's due heads for `worker`; returns the ids it holds now.
async fn fetch(inbox: &SqlxInbox, group: &str, worker: &str) -> Vec<Uuid> {
    let req = InboxFetchRequest::new(
        WorkerId::new(worker).expect("worker"),
        ConsumerGroup::new(group).expect("group"),
        10,
    );
    inbox
        .fetch_and_lock(&req)
        .await
        .expect("fetch")
        .iter()
        .map(|f| f.id())
        .collect()
}

fn json(out: &common::Out) -> Value {
    assert_eq!(out.code, 0, "{}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

/// `outbox-relay inbox <cmd> --store <store> --table <db.table>`.
fn args(db: &Db, store: &str, cmd: &[&str]) -> Vec<String> {
    let mut v = vec!["inbox".to_owned()];
    v.extend(cmd.iter().map(|s| s.to_string()));
    v.extend([
        "--store".into(),
        store.into(),
        "--table".into(),
        db.table.dotted(),
    ]);
    v
}

async fn run(db: &Db, store: &str, cmd: &[&str]) -> common::Out {
    let a = args(db, store, cmd);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    relay(&a).await
}

/// The row's (status, attempts_made, last_error, locked_by).
async fn row(db: &Db, id: Uuid) -> (String, i64, Option<String>, Option<String>) {
    let sql = db.table.qualified();
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status::text, attempts_made::int8, last_error, locked_by FROM {sql} WHERE id = $1"
    )))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .expect("row")
}

/// OP-10 on one store: the rows of group `billing` (source `orders`) and of group `audit` in
/// the states each command needs, then every command, its refusals first (exit 1 or 2, the
/// table unchanged), then its success (exit 0, `--json`, the rows changed).
async fn op_10(store: &str, layout: Layout) {
    let (db, inbox) = inbox_table(layout).await;
    // k-stale: held by a processor that died an hour ago; k-held: held under a live lease.
    let stale = land(&inbox, "billing", "k-stale", 0).await;
    assert_eq!(fetch(&inbox, "billing", "dead-worker").await, vec![stale]);
    let held = land(&inbox, "billing", "k-held", 0).await;
    assert_eq!(fetch(&inbox, "billing", "live-worker").await, vec![held]);
    db.exec(&format!(
        "UPDATE {{t}} SET locked_at = now() - interval '1 hour' WHERE id = '{stale}'"
    ))
    .await;
    // k-fail: failed for good; k-retry: its head waits for a retry, one row behind it.
    let failed = land(&inbox, "billing", "k-fail", 0).await;
    write(
        &inbox,
        failed,
        RowWrite::Terminal {
            error: "handler gave up".into(),
            exhausted: OnExhausted::Release,
        },
    )
    .await;
    let retry = land(&inbox, "billing", "k-retry", 0).await;
    let behind = land(&inbox, "billing", "k-retry", 1).await;
    write(
        &inbox,
        retry,
        RowWrite::Counted {
            error: "handler said no".into(),
            retry: Retry::After(std::time::Duration::from_secs(3600)),
            exhausted: OnExhausted::Release,
        },
    )
    .await;
    // Completed rows: one three days ago, one now; in group audit one three days ago and a
    // failed row.
    let old_done = land(&inbox, "billing", "k-done", 0).await;
    let new_done = land(&inbox, "billing", "k-done", 1).await;
    let audit_done = land(&inbox, "audit", "k-a", 0).await;
    let audit_failed = land(&inbox, "audit", "k-b", 0).await;
    for id in [old_done, new_done, audit_done] {
        write(&inbox, id, RowWrite::Complete).await;
    }
    write(
        &inbox,
        audit_failed,
        RowWrite::Terminal {
            error: "audit gave up".into(),
            exhausted: OnExhausted::Release,
        },
    )
    .await;
    db.exec(&format!(
        "UPDATE {{t}} SET completed_at = now() - interval '3 days' WHERE id IN ('{old_done}', '{audit_done}')"
    ))
    .await;

    // stats: group billing only, per source and status.
    let v = json(&run(&db, store, &["stats", "--group", "billing", "--json"]).await);
    assert_eq!(v["consumer_group"], "billing", "{v}");
    assert_eq!(v["table"], db.table.to_string(), "{v}");
    assert_eq!(
        (
            v["pending"].as_i64(),
            v["failed"].as_i64(),
            v["completed"].as_i64()
        ),
        (Some(4), Some(1), Some(2)),
        "{v}"
    );
    let counts = v["counts"].as_array().expect("counts");
    assert!(
        counts
            .iter()
            .all(|c| c["source"] == "orders" && c["consumer_group"] == "billing"),
        "{v}"
    );
    assert_eq!(v["blocked_keys"], 2, "k-held and k-retry: {v}");
    assert!(
        v["oldest_due_age_seconds"].as_f64().is_some(),
        "the stale row is due: {v}"
    );
    let out = run(&db, store, &["stats", "--group", "billing"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("pending 4  failed 1  completed 2  blocked keys 2"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("consumer group billing") && out.stdout.contains("SOURCE"),
        "{}",
        out.stdout
    );
    let v = json(&run(&db, store, &["stats", "--group", "nobody", "--json"]).await);
    assert_eq!(v["pending"], 0, "{v}");
    assert!(v["oldest_due_age_seconds"].is_null(), "{v}");

    // blocked-keys: oldest head first; the retrying head with the row behind it.
    let v = json(
        &run(
            &db,
            store,
            &["blocked-keys", "--group", "billing", "--json"],
        )
        .await,
    );
    let keys = v.as_array().expect("array");
    assert_eq!(keys.len(), 2, "{v}");
    assert_eq!(keys[0]["partition_key"], "k-held", "{v}");
    assert_eq!(keys[0]["head_id"], held.to_string());
    assert_eq!(keys[0]["locked_by"], "live-worker");
    assert_eq!(keys[1]["partition_key"], "k-retry", "{v}");
    assert_eq!(keys[1]["source"], "orders");
    assert_eq!(keys[1]["head_id"], retry.to_string());
    assert_eq!(keys[1]["message_id"], "billing-k-retry-0");
    assert_eq!(keys[1]["attempts_made"], 1);
    assert_eq!(keys[1]["waiting"], 1);
    assert_eq!(keys[1]["last_error"], "handler said no");
    let out = run(
        &db,
        store,
        &["blocked-keys", "--group", "billing", "--limit", "1"],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("k-held") && !out.stdout.contains("k-retry"),
        "{}",
        out.stdout
    );
    let out = run(&db, store, &["blocked-keys", "--group", "audit"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("no blocked keys of consumer group audit"),
        "{}",
        out.stdout
    );

    // requeue-failed: refusals change nothing.
    let before = db.digest().await;
    let out = run(&db, store, &["requeue-failed", &retry.to_string()]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("is pending, not failed"),
        "{}",
        out.stderr
    );
    let unknown = Uuid::new_v4().to_string();
    let out = run(&db, store, &["requeue-failed", &unknown]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("no inbox row {unknown}")),
        "{}",
        out.stderr
    );
    let out = run(
        &db,
        store,
        &[
            "requeue-failed",
            &audit_failed.to_string(),
            "--group",
            "billing",
        ],
    )
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("belongs to consumer group \"audit\", not \"billing\""),
        "{}",
        out.stderr
    );
    for bad in [&["requeue-failed", "not-a-uuid"][..], &["requeue-failed"]] {
        let out = run(&db, store, bad).await;
        assert_eq!(out.code, 2, "{bad:?}: {}", out.stderr);
    }
    assert_eq!(
        db.digest().await,
        before,
        "refused commands changed nothing"
    );
    // … and a failed row of the group goes back to pending.
    let v = json(
        &run(
            &db,
            store,
            &[
                "requeue-failed",
                &failed.to_string(),
                "--group",
                "billing",
                "--json",
            ],
        )
        .await,
    );
    assert_eq!(
        v["requeued"],
        serde_json::json!([failed.to_string()]),
        "{v}"
    );
    assert_eq!(
        row(&db, failed).await,
        (String::from("pending"), 0, None, None)
    );
    let out = run(&db, store, &["requeue-failed", &audit_failed.to_string()]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout.trim(), format!("requeued {audit_failed}"));
    assert_eq!(row(&db, audit_failed).await.0, "pending");

    // release-stale-locks: only the old lock.
    let before = db.digest().await;
    for bad in ["0s", "500ms", "soon"] {
        let out = run(&db, store, &["release-stale-locks", "--older-than", bad]).await;
        assert_eq!(out.code, 2, "{bad}: {}", out.stderr);
    }
    assert_eq!(db.digest().await, before);
    let v = json(
        &run(
            &db,
            store,
            &["release-stale-locks", "--older-than", "10m", "--json"],
        )
        .await,
    );
    assert_eq!(v["released"], 1, "{v}");
    assert_eq!(row(&db, stale).await.3, None);
    assert_eq!(row(&db, held).await.3.as_deref(), Some("live-worker"));

    // cleanup: completed rows older than two days, in every group.
    let before = db.digest().await;
    for bad in [
        &["--older-than", "1h"][..],
        &["--older-than", "36h"],
        &["--older-than", "0d"],
        &["--older-than", "2d", "--batch-size", "0"],
    ] {
        let mut cmd = vec!["cleanup"];
        cmd.extend_from_slice(bad);
        let out = run(&db, store, &cmd).await;
        assert_eq!(out.code, 2, "{bad:?}: {}", out.stderr);
    }
    assert_eq!(db.digest().await, before);
    let v = json(&run(&db, store, &["cleanup", "--older-than", "2d", "--json"]).await);
    assert_eq!(v["deleted"], 2, "{v}");
    assert_eq!(v["older_than_days"], 2, "{v}");
    for (id, n) in [(old_done, 0), (audit_done, 0), (new_done, 1), (behind, 1)] {
        assert_eq!(
            db.scalar_i64(&format!("SELECT count(*) FROM {{t}} WHERE id = '{id}'"))
                .await,
            n,
            "{id}"
        );
    }

    // force-unlock: refusals change nothing.
    let before = db.digest().await;
    let h = held.to_string();
    let h = h.as_str();
    let free = behind.to_string();
    for (cmd, code, needle) in [
        (vec!["force-unlock", h, "--reason", "   "], 2, "--reason"),
        (vec!["force-unlock", h], 2, "--reason"),
        (
            vec!["force-unlock", unknown.as_str(), "--reason", "x"],
            1,
            "is not locked",
        ),
        (
            vec!["force-unlock", free.as_str(), "--reason", "x"],
            1,
            "is not locked",
        ),
        (
            vec!["force-unlock", h, "--reason", "x", "--group", "audit"],
            1,
            "belongs to consumer group",
        ),
    ] {
        let out = run(&db, store, &cmd).await;
        assert_eq!(out.code, code, "{cmd:?}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{cmd:?}: {}", out.stderr);
    }
    let long = "x".repeat(256);
    let out = run(&db, store, &["force-unlock", h, "--reason", &long]).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert_eq!(
        db.digest().await,
        before,
        "refused commands changed nothing"
    );
    let v = json(
        &run(
            &db,
            store,
            &[
                "force-unlock",
                h,
                "--reason",
                " processor host died ",
                "--group",
                "billing",
                "--json",
            ],
        )
        .await,
    );
    assert_eq!(v["force_unlocked"], h, "{v}");
    let (status, _, last_error, locked_by) = row(&db, held).await;
    assert_eq!(
        (status.as_str(), last_error.as_deref(), locked_by),
        ("pending", Some("Force unlock: processor host died"), None)
    );

    // Nothing blocks the group now but the retrying head.
    let v = json(
        &run(
            &db,
            store,
            &["blocked-keys", "--group", "billing", "--json"],
        )
        .await,
    );
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn op_10_inbox_operator_commands_sqlx_plain_table() {
    op_10("sqlx", Layout::Plain).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn op_10_inbox_operator_commands_diesel_partitioned_table() {
    op_10("diesel", Layout::Partitioned).await;
}

/// OP-10's exit codes for a missing inbox table (3, with how to create it), a bad table name,
/// a bad or missing group (2), an unreachable database (3) whose URL's password is never
/// printed, on both stores.
#[tokio::test(flavor = "multi_thread")]
async fn op_10_inbox_commands_on_a_missing_table_bad_names_and_no_database() {
    let mut db = Db::fresh().await;
    db.table = TableName::new(&format!("{}.inbox_events", db.schema)).expect("table");
    let id = Uuid::new_v4().to_string();
    let id = id.as_str();
    for store in ["sqlx", "diesel"] {
        for cmd in [
            &["stats", "--group", "g"][..],
            &["blocked-keys", "--group", "g"],
            &["requeue-failed", id],
            &["release-stale-locks", "--older-than", "1m"],
            &["cleanup", "--older-than", "7d"],
            &["force-unlock", id, "--reason", "x"],
        ] {
            let out = run(&db, store, cmd).await;
            assert_eq!(out.code, 3, "{store} {cmd:?}: {}", out.stderr);
            assert!(
                out.stderr.contains("inbox table")
                    && out.stderr.contains("does not exist")
                    && out.stderr.contains("create_inbox_schema"),
                "{store} {cmd:?}: {}",
                out.stderr
            );
        }
    }
    let out = relay(&["inbox", "stats", "--group", "g", "--table", "Bad.Name"]).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("invalid inbox table name"),
        "{}",
        out.stderr
    );
    for group in [&["--group", "  "][..], &[]] {
        let mut a = vec!["inbox", "stats"];
        a.extend_from_slice(group);
        let out = common::command(&a)
            .env_remove("INBOX_GROUP")
            .output()
            .await
            .expect("run");
        assert_eq!(out.status.code(), Some(2), "{group:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--group"),
            "{group:?}"
        );
    }
    // An unreachable database: exit 3, and the URL's password is in no output, nor in --help.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres:s3cret-pw@127.0.0.1:{port}/test");
    for store in ["sqlx", "diesel"] {
        let out = relay(&[
            "inbox",
            "stats",
            "--group",
            "g",
            "--store",
            store,
            "--database-url",
            &url,
        ])
        .await;
        assert_eq!(out.code, 3, "{}", out.stderr);
        assert!(
            out.stderr.contains("could not connect to PostgreSQL"),
            "{}",
            out.stderr
        );
        assert!(!(out.stderr + &out.stdout).contains("s3cret-pw"));
    }
    for sub in ["stats", "cleanup", "force-unlock"] {
        let out = common::command(&["inbox", sub, "--help"])
            .env("DATABASE_URL", &url)
            .output()
            .await
            .expect("help");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("DATABASE_URL"), "{text}");
        assert!(!text.contains("s3cret-pw"), "{text}");
    }
    db.drop_schema().await;
}

/// R192 on one store: a poison key of group `billing` parked (the processor's counted write
/// with on_exhausted park spends the last of its 3 attempts), two rows behind it; `inbox
/// blocked-keys` shows it PARKED; refusals (a pending row with attempts left, a discard without
/// a reason, a row of another group) change nothing; `inbox redrive --source --key` makes the
/// head due again ahead of its key; parked again, `inbox discard` fails it with the reason.
async fn redrive_and_discard(store: &str, layout: Layout) {
    let (db, inbox) = inbox_table(layout).await;
    let head = land(&inbox, "billing", "k-poison", 0).await;
    let behind = land(&inbox, "billing", "k-poison", 1).await;
    land(&inbox, "billing", "k-poison", 2).await;
    let park = |n: u32| RowWrite::Counted {
        error: format!("poison {n}"),
        retry: Retry::After(std::time::Duration::from_secs(1)),
        exhausted: OnExhausted::Park,
    };
    for n in 1..=3 {
        write(&inbox, head, park(n)).await;
    }
    assert_eq!(
        row(&db, head).await,
        ("pending".into(), 3, Some("poison 3".into()), None),
        "parked"
    );
    let keys = json(
        &run(
            &db,
            store,
            &["blocked-keys", "--group", "billing", "--json"],
        )
        .await,
    );
    assert_eq!(keys[0]["head_id"], head.to_string(), "{keys}");
    assert_eq!(keys[0]["parked"], true, "{keys}");
    let text = run(&db, store, &["blocked-keys", "--group", "billing"]).await;
    assert!(text.stdout.contains("PARKED"), "{}", text.stdout);

    let before = db.digest().await;
    let out = run(
        &db,
        store,
        &["redrive", "--group", "billing", &behind.to_string()],
    )
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("is pending with 0 of 3 attempts spent, not parked"),
        "{}",
        out.stderr
    );
    let out = run(
        &db,
        store,
        &["redrive", "--group", "audit", &head.to_string()],
    )
    .await;
    assert_eq!(out.code, 1, "another group's row: {}", out.stderr);
    let out = run(
        &db,
        store,
        &[
            "discard",
            "--group",
            "billing",
            &head.to_string(),
            "--reason",
            " ",
        ],
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    let out = run(
        &db,
        store,
        &["discard", "--group", "billing", &head.to_string()],
    )
    .await;
    assert_eq!(out.code, 2, "--reason is required: {}", out.stderr);
    let out = run(
        &db,
        store,
        &["redrive", "--group", "billing", "--source", "none"],
    )
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert_eq!(
        db.digest().await,
        before,
        "refused commands changed nothing"
    );

    let v = json(
        &run(
            &db,
            store,
            &[
                "redrive", "--group", "billing", "--source", "orders", "--key", "k-poison",
                "--json",
            ],
        )
        .await,
    );
    assert_eq!(v["redriven"], serde_json::json!([head.to_string()]), "{v}");
    assert_eq!(row(&db, head).await, ("pending".into(), 0, None, None));
    assert_eq!(
        fetch(&inbox, "billing", "p1").await[0],
        head,
        "the head goes first"
    );
    db.exec("UPDATE {t} SET locked_at = NULL, locked_by = NULL")
        .await;

    for n in 1..=3 {
        write(&inbox, head, park(n)).await;
    }
    let out = run(
        &db,
        store,
        &[
            "discard",
            "--group",
            "billing",
            &head.to_string(),
            "--reason",
            "bad payload",
        ],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("discarded 1"), "{}", out.stdout);
    assert_eq!(
        row(&db, head).await,
        (
            "failed".into(),
            3,
            Some("discarded: bad payload; poison 3".into()),
            None
        )
    );
    assert_eq!(
        fetch(&inbox, "billing", "p1").await[0],
        behind,
        "the key goes on without the discarded row"
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn inbox_redrive_and_discard_sqlx_plain_table() {
    redrive_and_discard("sqlx", Layout::Plain).await;
}

#[cfg(feature = "diesel")]
#[tokio::test(flavor = "multi_thread")]
async fn inbox_redrive_and_discard_diesel_partitioned_table() {
    redrive_and_discard("diesel", Layout::Partitioned).await;
}
