//! The `outbox-relay` binary on a backlog with a stuck key (issue 11, R85): one key whose head
//! waits for a retry an hour ahead with rows queued behind it, plus many keys of one due row,
//! all newer, drained by two relay processes at once, in each delivery mode. At a size CI can
//! afford (2,000 rows behind the stuck head, 20,000 one-row keys); the same shape at 100,000
//! keys is run by hand (see outbox-postgres/README.md) with the same command line.

mod common;

use std::time::{Duration, Instant};

use common::{Db, command, wait};

async fn stuck_key_backlog(mode: &str) {
    let db = Db::fresh().await;
    db.migrate().await;
    let (behind, keys) = (2_000, 20_000);
    let row = |n: &str, key: &str, ago: &str, sched: &str, attempts: u32, err: &str| {
        format!(
            "INSERT INTO {{t}} (id, event_type, payload, status, attempts_made, max_attempts, last_error, \
             scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
             SELECT gen_random_uuid(), 'backlog', '{{\"n\": 1}}', 'pending', {attempts}, 6, {err}, {sched}, \
                    ts, ts, 'agg', gen_random_uuid(), 'orders', {key} \
               FROM generate_series(1, {n}) g, \
                    LATERAL (SELECT now() - interval '{ago}' + g * interval '1 millisecond' AS ts) x"
        )
    };
    db.exec(&row(
        "1",
        "'stuck'",
        "3 hours",
        "now() + interval '1 hour'",
        1,
        "'broker said no'",
    ))
    .await;
    db.exec(&row(
        &behind.to_string(),
        "'stuck'",
        "2 hours",
        "ts",
        0,
        "NULL",
    ))
    .await;
    db.exec(&row(
        &keys.to_string(),
        "'k' || g",
        "1 hour",
        "ts",
        0,
        "NULL",
    ))
    .await;
    db.exec("ANALYZE {t}").await;

    let args = |worker: &str| -> Vec<String> {
        [
            "run",
            "--table",
            &db.table_arg(),
            "--broker",
            "noop",
            "--worker-id",
            worker,
            "--delivery",
            mode,
            "--batch-size",
            "100",
            "--until-drained",
            "--summary-interval",
            "0",
            "--poll-interval",
            "200ms",
        ]
        .map(String::from)
        .to_vec()
    };
    let started = Instant::now();
    let (a, b) = (args("backlog-a"), args("backlog-b"));
    let spawn = |v: &Vec<String>| {
        command(&v.iter().map(String::as_str).collect::<Vec<_>>())
            .spawn()
            .expect("spawn")
    };
    let (pa, pb) = (spawn(&a), spawn(&b));
    let (oa, ob) = tokio::join!(
        wait(pa, Duration::from_secs(300)),
        wait(pb, Duration::from_secs(300))
    );
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(oa.code, 0, "relay a: {}", oa.stderr);
    assert_eq!(ob.code, 0, "relay b: {}", ob.stderr);
    assert!(
        !oa.stderr.contains("out of shared memory") && !ob.stderr.contains("fetch failed"),
        "{}\n{}",
        oa.stderr,
        ob.stderr
    );
    let completed = db
        .scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
        .await;
    assert_eq!(completed, keys, "every one-row key drained");
    let stuck = db
        .scalar_i64(
            "SELECT count(*) FROM {t} WHERE partition_key = 'stuck' AND status = 'pending' \
             AND locked_at IS NULL AND attempts_made = 0",
        )
        .await;
    assert_eq!(
        stuck, behind,
        "the rows behind the stuck head stay untouched"
    );
    eprintln!(
        "{mode}: two relays drained {keys} one-row keys past a stuck key with {behind} rows behind it in {secs:.1} s ({:.0} ev/s)",
        keys as f64 / secs
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_relays_drain_past_a_stuck_key_in_lease_delivery() {
    stuck_key_backlog("lease").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_relays_drain_past_a_stuck_key_in_transaction_delivery() {
    stuck_key_backlog("transaction").await;
}
