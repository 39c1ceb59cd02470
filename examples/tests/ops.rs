//! Each operator command of `outbox-relay` against a real table (a fresh schema per test),
//! including bad input that fails with a clear error, the documented exit code, and no change.

mod common;

use common::{Db, relay};
use uuid::Uuid;

async fn table_with_events(
    keys: usize,
    per_key: usize,
) -> (Db, std::collections::HashMap<String, Vec<Uuid>>) {
    let db = Db::fresh().await;
    db.migrate().await;
    let w = db.write_events("ops", keys, per_key, 10).await;
    (db, w)
}

fn args<'a>(db: &'a Db, cmd: &'a [&'a str]) -> Vec<&'a str> {
    let mut v = cmd.to_vec();
    v.push("--table");
    v.push(Box::leak(db.table_arg().into_boxed_str()));
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_creates_the_table_and_is_idempotent() {
    let db = Db::fresh().await;
    db.migrate().await;
    db.migrate().await;
    assert_eq!(db.scalar_i64("SELECT count(*) FROM {t}").await, 0);
    db.drop_schema().await;
}

/// `migrate --partitioned` creates the partitioned table (default partition and this month
/// plus --months-ahead, on each store), adds months when run again, refuses a plain table and
/// a bad --months-ahead; bad table names are refused as before.
#[tokio::test(flavor = "multi_thread")]
async fn migrate_partitioned_creates_the_partitioned_table_and_refuses_bad_names() {
    let db = Db::fresh().await;
    let kind = |t: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)",
            )
            .bind(t)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let parts = |t: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1)",
            )
            .bind(t)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let out = relay(&args(&db, &["migrate", "--partitioned"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("partitioned"), "{}", out.stdout);
    assert_eq!(kind(db.table_arg()).await.as_deref(), Some("p"));
    assert_eq!(
        parts(db.table_arg()).await,
        1 + 4,
        "default + this month + 3"
    );
    let out = relay(&args(
        &db,
        &["migrate", "--partitioned", "--months-ahead", "5"],
    ))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(parts(db.table_arg()).await, 1 + 6);
    let out = relay(&args(
        &db,
        &["migrate", "--partitioned", "--months-ahead", "121"],
    ))
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("--months-ahead"), "{}", out.stderr);
    assert_eq!(parts(db.table_arg()).await, 1 + 6);

    // The relay's commands work on it: stats sees rows written by the partitioned writer.
    let w = txoutbox_postgres::PgOutboxWriter::with_layout(
        &db.table,
        txoutbox_postgres::Layout::Partitioned,
    );
    let mut tx = db.pool.begin().await.unwrap();
    let ev = txoutbox_core::NewEvent::builder()
        .topic("ops")
        .partition_key("k")
        .event_type("e")
        .idempotency_key("once")
        .payload_json(serde_json::json!({"n": 1}))
        .aggregate("a", Uuid::new_v4())
        .build()
        .unwrap();
    w.write(&mut tx, vec![ev.clone(), ev]).await.unwrap();
    tx.commit().await.unwrap();
    let out = relay(&args(&db, &["stats", "--json"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let stats: serde_json::Value = serde_json::from_str(&out.stdout).expect("JSON");
    assert_eq!(stats["pending"], 1, "{stats}");

    // An existing plain table is never converted.
    let plain = format!("{}.plain_events", db.schema);
    let out = relay(&["migrate", "--table", &plain]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = relay(&["migrate", "--partitioned", "--table", &plain]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stderr.contains("is not partitioned"), "{}", out.stderr);
    assert_eq!(kind(plain).await.as_deref(), Some("r"));

    #[cfg(feature = "diesel")]
    {
        let t = format!("{}.diesel_events", db.schema);
        let out = relay(&[
            "migrate",
            "--store",
            "diesel",
            "--partitioned",
            "--table",
            &t,
        ])
        .await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(kind(t.clone()).await.as_deref(), Some("p"));
        assert_eq!(parts(t.clone()).await, 1 + 4);
        let out = relay(&[
            "migrate",
            "--store",
            "diesel",
            "--partitioned",
            "--months-ahead",
            "6",
            "--table",
            &t,
        ])
        .await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(
            parts(t).await,
            1 + 7,
            "months are added after the one-time migration"
        );
    }
    db.drop_schema().await;

    for bad in ["Outbox", "a.b.c", "x-y", "t;drop table x"] {
        let out = relay(&["migrate", "--table", bad]).await;
        assert_eq!(out.code, 2, "{bad}: {}", out.stderr);
        assert!(
            out.stderr.contains("invalid outbox table name"),
            "{bad}: {}",
            out.stderr
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn commands_on_a_missing_table_say_to_migrate() {
    let db = Db::fresh().await;
    for cmd in [
        &["stats"][..],
        &["blocked-keys"],
        &["requeue-failed", "--topic", "x"],
        &["release-stale-locks", "--older-than", "1m"],
        &["cleanup", "--older-than", "7d"],
        &[
            "force-unlock",
            "00000000-0000-0000-0000-000000000001",
            "--reason",
            "x",
        ],
        &["run", "--broker", "noop", "--until-drained"],
    ] {
        let out = relay(&args(&db, cmd)).await;
        assert_eq!(out.code, 3, "{cmd:?}: {}", out.stderr);
        assert!(
            out.stderr.contains("run `outbox-relay migrate"),
            "{cmd:?}: {}",
            out.stderr
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_database_urls_are_usage_or_database_errors() {
    let out = relay(&["stats", "--database-url", "mysql://root@localhost/x"]).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("postgres://"), "{}", out.stderr);
    // A port where nothing listens (bound and released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let out = relay(&["stats", "--database-url", &url]).await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(
        out.stderr.contains("could not connect to PostgreSQL"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_counts_rows_per_status() {
    let (db, _) = table_with_events(3, 4).await;
    db.exec("UPDATE {t} SET status = 'failed', attempts_made = max_attempts, last_error = 'boom' WHERE partition_key = 'key-0'")
        .await;
    let out = relay(&args(&db, &["stats", "--json"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    assert_eq!(v["pending"], 8);
    assert_eq!(v["failed"], 4);
    assert_eq!(v["completed"], 0);
    assert!(v["oldest_due_age_seconds"].as_f64().is_some());
    let out = relay(&args(&db, &["stats"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("pending 8  failed 4  completed 0"),
        "{}",
        out.stdout
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn blocked_keys_lists_a_key_whose_head_waits_for_a_retry() {
    let (db, w) = table_with_events(3, 3).await;
    let head = w["key-1"][0];
    db.exec(&format!(
        "UPDATE {{t}} SET attempts_made = 1, last_error = 'broker said no', scheduled_at = now() + interval '1 hour' WHERE id = '{head}'"
    ))
    .await;
    let out = relay(&args(&db, &["blocked-keys", "--json"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    let keys = v.as_array().expect("array");
    assert_eq!(keys.len(), 1, "{v}");
    assert_eq!(keys[0]["partition_key"], "key-1");
    assert_eq!(keys[0]["head_id"], head.to_string());
    assert_eq!(keys[0]["waiting"], 2);
    assert_eq!(keys[0]["last_error"], "broker said no");
    let out = relay(&args(&db, &["blocked-keys"])).await;
    assert!(
        out.stdout.contains("key-1") && out.stdout.contains("broker said no"),
        "{}",
        out.stdout
    );
    let out = relay(&args(&db, &["blocked-keys", "--limit", "0"])).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn requeue_failed_by_id_and_by_key_and_refuses_unknown_or_pending_rows() {
    let (db, w) = table_with_events(2, 3).await;
    db.exec("UPDATE {t} SET status = 'failed', attempts_made = max_attempts, last_error = 'boom'")
        .await;
    let one = w["key-0"][0];
    let out = relay(&args(&db, &["requeue-failed", &one.to_string()])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        db.scalar_i64(&format!("SELECT count(*) FROM {{t}} WHERE id = '{one}' AND status = 'pending' AND attempts_made = 0 AND last_error IS NULL")).await,
        1
    );

    let before = db.digest().await;
    // The row is pending now: refused, nothing changed.
    let out = relay(&args(&db, &["requeue-failed", &one.to_string()])).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("is pending, not failed"),
        "{}",
        out.stderr
    );
    let unknown = Uuid::new_v4().to_string();
    let out = relay(&args(&db, &["requeue-failed", &unknown])).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("no event {unknown}")),
        "{}",
        out.stderr
    );
    let out = relay(&args(&db, &["requeue-failed", "--key", "no-such-key"])).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    let out = relay(&args(&db, &["requeue-failed", "not-a-uuid"])).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    let out = relay(&args(&db, &["requeue-failed"])).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert_eq!(
        db.digest().await,
        before,
        "refused commands changed nothing"
    );

    let out = relay(&args(
        &db,
        &["requeue-failed", "--key", "key-1", "--topic", "ops"],
    ))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("requeued 3"), "{}", out.stdout);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'failed'")
            .await,
        2
    );
    let out = relay(&args(&db, &["requeue-failed", "--topic", "ops", "--json"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    assert_eq!(v["requeued"].as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'failed'")
            .await,
        0
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn release_stale_locks_releases_old_locks_only() {
    let (db, w) = table_with_events(2, 2).await;
    let (old, fresh) = (w["key-0"][0], w["key-1"][0]);
    db.exec(&format!("UPDATE {{t}} SET locked_by = 'dead', locked_at = now() - interval '1 hour' WHERE id = '{old}'")).await;
    db.exec(&format!(
        "UPDATE {{t}} SET locked_by = 'alive', locked_at = now() WHERE id = '{fresh}'"
    ))
    .await;

    let before = db.digest().await;
    for bad in ["0s", "500ms", "soon"] {
        let out = relay(&args(&db, &["release-stale-locks", "--older-than", bad])).await;
        assert_eq!(out.code, 2, "{bad}: {}", out.stderr);
    }
    assert_eq!(db.digest().await, before);

    let out = relay(&args(&db, &["release-stale-locks", "--older-than", "10m"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("released 1"), "{}", out.stdout);
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM {{t}} WHERE id = '{old}' AND locked_by IS NULL"
        ))
        .await,
        1
    );
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM {{t}} WHERE id = '{fresh}' AND locked_by = 'alive'"
        ))
        .await,
        1
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cleanup_deletes_old_completed_rows_only() {
    let (db, w) = table_with_events(3, 1).await;
    let (old, recent, pending) = (w["key-0"][0], w["key-1"][0], w["key-2"][0]);
    db.exec(&format!("UPDATE {{t}} SET status = 'completed', completed_at = now() - interval '3 days' WHERE id = '{old}'")).await;
    db.exec(&format!("UPDATE {{t}} SET status = 'completed', completed_at = now() - interval '1 hour' WHERE id = '{recent}'")).await;

    let before = db.digest().await;
    for bad in ["1h", "36h", "0d"] {
        let out = relay(&args(&db, &["cleanup", "--older-than", bad])).await;
        assert_eq!(out.code, 2, "{bad}: {}", out.stderr);
        assert!(
            out.stderr.contains("whole number of days"),
            "{}",
            out.stderr
        );
    }
    let out = relay(&args(
        &db,
        &["cleanup", "--older-than", "2d", "--batch-size", "0"],
    ))
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert_eq!(db.digest().await, before);

    let out = relay(&args(&db, &["cleanup", "--older-than", "2d"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("deleted 1"), "{}", out.stdout);
    for (id, n) in [(old, 0), (recent, 1), (pending, 1)] {
        assert_eq!(
            db.scalar_i64(&format!("SELECT count(*) FROM {{t}} WHERE id = '{id}'"))
                .await,
            n
        );
    }
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn force_unlock_releases_a_held_row_and_refuses_bad_input() {
    let (db, w) = table_with_events(2, 1).await;
    let (held, free) = (w["key-0"][0], w["key-1"][0]);
    db.exec(&format!(
        "UPDATE {{t}} SET locked_by = 'stuck-relay', locked_at = now() WHERE id = '{held}'"
    ))
    .await;

    let before = db.digest().await;
    let out = relay(&args(
        &db,
        &["force-unlock", &held.to_string(), "--reason", "   "],
    ))
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("--reason"), "{}", out.stderr);
    let long = "x".repeat(256);
    let out = relay(&args(
        &db,
        &["force-unlock", &held.to_string(), "--reason", &long],
    ))
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    let out = relay(&args(
        &db,
        &["force-unlock", &Uuid::new_v4().to_string(), "--reason", "x"],
    ))
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stderr.contains("is not locked"), "{}", out.stderr);
    let out = relay(&args(
        &db,
        &["force-unlock", &free.to_string(), "--reason", "x"],
    ))
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    let out = relay(&args(&db, &["force-unlock", &held.to_string()])).await;
    assert_eq!(out.code, 2, "missing --reason: {}", out.stderr);
    assert_eq!(
        db.digest().await,
        before,
        "refused commands changed nothing"
    );

    let out = relay(&args(
        &db,
        &[
            "force-unlock",
            &held.to_string(),
            "--reason",
            " relay host died ",
        ],
    ))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        db.scalar_i64(&format!("SELECT count(*) FROM {{t}} WHERE id = '{held}' AND locked_by IS NULL AND last_error = 'Force unlock: relay host died'")).await,
        1
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn run_refuses_invalid_settings_before_connecting() {
    let db = Db::fresh().await;
    for (flags, needle) in [
        (
            &["--broker", "stdout", "--worker-id", "has space"][..],
            "worker",
        ),
        (&["--broker", "stdout", "--batch-size", "0"], "batch_size"),
        (
            &[
                "--broker",
                "stdout",
                "--lease",
                "10s",
                "--publish-timeout",
                "30s",
            ],
            "lease_ttl",
        ),
        (
            &["--broker", "stdout", "--poll-interval", "fast"],
            "duration",
        ),
        (
            &["--broker", "stdout", "--metrics-prefix", "1bad"],
            "metrics prefix",
        ),
    ]
    .into_iter()
    // A broker that this build does not compile in is refused (the case exists only when the
    // `kafka` feature is off: with it, `--broker kafka` is a valid choice).
    .chain((!cfg!(feature = "kafka")).then_some((&["--broker", "kafka"][..], "kafka")))
    {
        let mut a = args(&db, &["run"]);
        a.extend_from_slice(flags);
        let out = relay(&a).await;
        assert_eq!(out.code, 2, "{flags:?}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{flags:?}: {}", out.stderr);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn run_until_drained_with_the_stdout_broker_prints_each_event() {
    let (db, w) = table_with_events(2, 3).await;
    let out = relay(&args(
        &db,
        &["run", "--broker", "stdout", "--until-drained"],
    ))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let lines: Vec<serde_json::Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 6);
    for (key, ids) in &w {
        let got: Vec<String> = lines
            .iter()
            .filter(|l| l["partition_key"] == key.as_str())
            .map(|l| l["attributes"]["event_id"].as_str().unwrap().to_owned())
            .collect();
        let want: Vec<String> = ids.iter().map(Uuid::to_string).collect();
        assert_eq!(got, want, "key {key}");
    }
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
            .await,
        6
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_mid_drain_records_what_was_published_and_releases_the_rest() {
    use tokio::io::AsyncBufReadExt;
    let (db, _) = table_with_events(20, 100).await;
    let mut a = args(
        &db,
        &[
            "run",
            "--broker",
            "stdout",
            "--batch-size",
            "10",
            "--publish-concurrency",
            "2",
        ],
    );
    a.extend_from_slice(&["--summary-interval", "0"]);
    let mut child = common::command(&a).spawn().expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut printed = 0usize;
    while printed < 100 {
        lines
            .next_line()
            .await
            .expect("read")
            .expect("relay exited early");
        printed += 1;
    }
    let pid = child.id().expect("pid").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(kill.success());
    while lines.next_line().await.expect("read").is_some() {
        printed += 1;
    }
    let out = common::wait(child, std::time::Duration::from_secs(30)).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains("signal received"), "{}", out.stderr);
    // Every event printed was recorded as completed, and nothing stays locked.
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
            .await as usize,
        printed
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE locked_at IS NOT NULL")
            .await,
        0
    );
    eprintln!("stopped after {printed} of 2000 events");
    db.drop_schema().await;
}

/// R192 on the outbox table, on each store: a parked head (pending, every attempt spent, as
/// `run --on-exhausted park` leaves it) shows as PARKED; redrive and discard refuse other rows
/// and bad input (exit 1 or 2, nothing changed); redrive by key makes it due with no attempts;
/// discard by id fails it with `discarded: <reason>; ` and its old error.
#[tokio::test(flavor = "multi_thread")]
async fn redrive_and_discard_parked_rows_on_both_stores() {
    let (db, w) = table_with_events(2, 3).await;
    let stores: &[&str] = if cfg!(feature = "diesel") {
        &["sqlx", "diesel"]
    } else {
        &["sqlx"]
    };
    for store in stores {
        let park = |id: Uuid| {
            format!(
                "UPDATE {{t}} SET attempts_made = max_attempts, last_error = 'poison', \
                 status = 'pending', completed_at = NULL WHERE id = '{id}'"
            )
        };
        fn with_store<'a>(c: &[&'a str], store: &'a str) -> Vec<&'a str> {
            let mut v = c.to_vec();
            v.extend(["--store", store]);
            v
        }
        let (head, behind) = (w["key-0"][0], w["key-0"][1]);
        db.exec(&park(head)).await;
        let out = relay(&args(&db, &with_store(&["blocked-keys", "--json"], store))).await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
        assert_eq!(v[0]["head_id"], head.to_string(), "{v}");
        assert_eq!(v[0]["parked"], true, "{v}");
        let out = relay(&args(&db, &with_store(&["blocked-keys"], store))).await;
        assert!(out.stdout.contains("PARKED"), "{}", out.stdout);

        let before = db.digest().await;
        let out = relay(&args(
            &db,
            &with_store(&["redrive", &behind.to_string()], store),
        ))
        .await;
        assert_eq!(out.code, 1, "{}", out.stderr);
        assert!(
            out.stderr
                .contains("is pending with 0 of 6 attempts spent, not parked"),
            "{}",
            out.stderr
        );
        let out = relay(&args(
            &db,
            &with_store(&["discard", &head.to_string()], store),
        ))
        .await;
        assert_eq!(out.code, 2, "--reason required: {}", out.stderr);
        let out = relay(&args(
            &db,
            &with_store(&["discard", &head.to_string(), "--reason", ""], store),
        ))
        .await;
        assert_eq!(out.code, 2, "{}", out.stderr);
        let out = relay(&args(
            &db,
            &with_store(&["redrive", "--key", "key-0"], store),
        ))
        .await;
        assert_eq!(out.code, 2, "--key needs --topic: {}", out.stderr);
        let out = relay(&args(
            &db,
            &with_store(&["redrive", "--topic", "none"], store),
        ))
        .await;
        assert_eq!(out.code, 1, "{}", out.stderr);
        assert_eq!(
            db.digest().await,
            before,
            "refused commands changed nothing"
        );

        let out = relay(&args(
            &db,
            &with_store(
                &["redrive", "--topic", "ops", "--key", "key-0", "--json"],
                store,
            ),
        ))
        .await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
        assert_eq!(v["redriven"], serde_json::json!([head.to_string()]), "{v}");
        assert_eq!(
            db.scalar_i64(&format!("SELECT count(*) FROM {{t}} WHERE id = '{head}' AND status = 'pending' AND attempts_made = 0 AND last_error IS NULL AND scheduled_at <= now()")).await,
            1
        );

        db.exec(&park(head)).await;
        let out = relay(&args(
            &db,
            &with_store(
                &["discard", &head.to_string(), "--reason", "bad payload"],
                store,
            ),
        ))
        .await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(
            db.scalar_i64(&format!("SELECT count(*) FROM {{t}} WHERE id = '{head}' AND status = 'failed' AND last_error = 'discarded: bad payload; poison'")).await,
            1
        );
        // Back for the next store.
        db.exec(&format!(
            "UPDATE {{t}} SET status = 'pending', attempts_made = 0, last_error = NULL WHERE id = '{head}'"
        ))
        .await;
    }
    db.drop_schema().await;
}
