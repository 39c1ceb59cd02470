//! K-19: the relay on Kafka keeps each key's order across a broker restart (issue 23).
//!
//! A private Tansu (never the shared one) is killed while the relay drains a backlog and a new
//! one is started on the same port. Tansu 0.6.0 here has only its memory storage (its PostgreSQL
//! engine is not compiled into the binary, and it has no file engine), so the records the first
//! broker stored are gone with it, the topic is created again, and the idempotent producer's id
//! and sequences are unknown to the second broker. What the test shows is therefore about the
//! second broker: every event the first broker had not acknowledged before it died reaches it, each key's
//! records there are a gap-free run of that key's events in write order (first deliveries), and
//! every row is completed in the end.

mod common;

use std::collections::{BTreeMap, HashSet};

use common::*;
use txoutbox_core::broker::{Probe, ReconnectWatch};
use txoutbox_core::{
    Ack, Backoff, BrokerError, CancellationToken, InMemoryRepository, Message, NewEvent, Relay,
    RunOptions, Status, SystemClock,
};

const KEYS: usize = 40;
const PER_KEY: usize = 25;
const PARTITIONS: i32 = 4;

fn event(topic: &str, key: usize, i: usize) -> NewEvent {
    NewEvent::builder()
        .event_type("restart.t")
        .aggregate("a", uuid::Uuid::new_v4())
        .topic(topic)
        .partition_key(format!("k{key}"))
        .payload_json(serde_json::json!({ "k": key, "i": i }))
        .build()
        .expect("valid event")
}

/// (key, index) of a row, from its payload.
fn key_index(payload: &[u8]) -> (usize, usize) {
    let v: serde_json::Value = serde_json::from_slice(payload).expect("JSON payload");
    (
        v["k"].as_u64().expect("k") as usize,
        v["i"].as_u64().expect("i") as usize,
    )
}

/// Per key, the indexes of the rows completed so far.
fn completed(repo: &InMemoryRepository) -> Vec<HashSet<usize>> {
    let mut out = vec![HashSet::new(); KEYS];
    for r in repo.rows() {
        if r.status == Status::Completed {
            let (k, i) = key_index(r.payload.to_string().as_bytes());
            out[k].insert(i);
        }
    }
    out
}

/// The adapter, recording per key the indexes whose publish it acknowledged (a publish that
/// returned `Ok`), so the test knows which acknowledgements came before the second broker
/// existed (the relay writes a cycle's outcomes after the whole cycle, later than the ack).
struct Recording {
    inner: Arc<KafkaBroker>,
    acked: std::sync::Mutex<Vec<HashSet<usize>>>,
}

impl Recording {
    fn acked(&self) -> Vec<HashSet<usize>> {
        self.acked.lock().expect("acked").clone()
    }
}

#[async_trait]
impl Broker for Recording {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let r = self.inner.publish(m).await;
        if r.is_ok() {
            let (k, i) = key_index(&m.body);
            self.acked.lock().expect("acked")[k].insert(i);
        }
        r
    }
    fn messaging_system(&self) -> &'static str {
        self.inner.messaging_system()
    }
    fn destination_name(&self, m: &Message) -> String {
        self.inner.destination_name(m)
    }
    fn reconnects(&self) -> Option<ReconnectWatch> {
        self.inner.reconnects()
    }
    async fn probe(&self) -> Probe {
        self.inner.probe().await
    }
}

async fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// K-19: 40 keys × 25 events through the relay (idempotence on when the broker grants it) into
/// a private Tansu that is killed once a third of the rows are completed and started again on
/// the same port with the topic recreated. On the new broker, per key: the records are the
/// key's events from some index s on, each once in first-delivery order, and s is at most the
/// first event the first broker did not acknowledge; all 1,000 rows end completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_19() {
    assert!(
        std::env::var_os("KAFKA_BROKERS").is_none(),
        "K-19 restarts a broker it starts itself (Tansu); it cannot run against KAFKA_BROKERS"
    );
    let port = txoutbox_conformance::broker::closed_port().await;
    let bootstrap = port.to_string();
    let mut tansu = start_tansu(port, port).await;
    let topic = format!("ob.restart-{}", fresh_suffix());
    create_topic_at(&bootstrap, &topic, PARTITIONS, &[]).await;

    let cfg = |i| {
        KafkaBrokerConfig::new(bootstrap.clone())
            .idempotence(i)
            .delivery_timeout(Duration::from_secs(3))
            .connect_timeout(Duration::from_millis(500))
    };
    let broker = KafkaBroker::connect_lazy(cfg(Idempotence::On)).expect("lazy");
    let idempotence = match broker.check().await {
        Ok(()) => Idempotence::On,
        Err(e) => {
            txoutbox_conformance::kafka::report(&format!(
                "K-19 runs with idempotence off: this broker grants no idempotent producer ({e})"
            ));
            Idempotence::Off
        }
    };
    let broker = Arc::new(KafkaBroker::connect_lazy(cfg(idempotence)).expect("lazy"));

    let repo = Arc::new(InMemoryRepository::new(Arc::new(SystemClock)));
    let mut rows = Vec::new();
    for i in 0..PER_KEY {
        for k in 0..KEYS {
            rows.push(event(&topic, k, i));
        }
    }
    repo.write_committed(rows).await.expect("write the backlog");
    let total = KEYS * PER_KEY;

    let recording = Arc::new(Recording {
        inner: broker.clone(),
        acked: std::sync::Mutex::new(vec![HashSet::new(); KEYS]),
    });
    let relay = Relay::builder(repo.clone(), recording.clone())
        .worker_id("k19")
        .publish_timeout(broker.publish_bound() + Duration::from_secs(2))
        .poll_interval(Duration::from_millis(100))
        .backoff(Backoff::new(0.2, 1.0).expect("backoff"))
        .build()
        .expect("relay");
    let stop = CancellationToken::new();
    let run = {
        let stop = stop.clone();
        tokio::spawn(async move {
            relay
                .run_with(
                    stop,
                    RunOptions::new()
                        .probe_interval(Duration::from_millis(100))
                        .expect("probe interval"),
                )
                .await
        })
    };

    // Mid-drain: kill the broker (SIGKILL, its memory storage is lost).
    wait_until(
        "a third of the rows completed",
        Duration::from_secs(60),
        || completed(&repo).iter().map(HashSet::len).sum::<usize>() >= total / 3,
    )
    .await;
    tansu.kill().await.expect("kill the private Tansu");
    let _ = tansu.wait().await;
    // Publishes the first broker answered before it died end within moments; the broker
    // trial's one fixed wait.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Everything acknowledged so far was acknowledged by the first broker.
    let at_kill = recording.acked();
    let done_at_kill: usize = at_kill.iter().map(HashSet::len).sum();
    assert!(
        done_at_kill < total,
        "the backlog drained before the kill ({done_at_kill} of {total})"
    );
    // The first index per key the first broker did not acknowledge.
    let first_open: Vec<usize> = at_kill
        .iter()
        .map(|s| (0..PER_KEY).find(|i| !s.contains(i)).unwrap_or(PER_KEY))
        .collect();
    for (k, s) in at_kill.iter().enumerate() {
        assert!(
            s.iter().all(|i| *i < first_open[k]),
            "key k{k}: an event was acknowledged while an earlier one was not: {s:?}"
        );
    }

    let _tansu2 = start_tansu(port, port).await;
    create_topic_at(&bootstrap, &topic, PARTITIONS, &[]).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while completed(&repo).iter().map(HashSet::len).sum::<usize>() < total {
        if tokio::time::Instant::now() >= deadline {
            let open: Vec<_> = repo
                .rows()
                .into_iter()
                .filter(|r| r.status != Status::Completed)
                .map(|r| (r.status, r.attempts_made, r.last_error))
                .take(5)
                .collect();
            panic!(
                "idempotence {idempotence:?}: {} of {total} rows completed 60 s after the restart ({done_at_kill} acknowledged before the kill); open rows: {open:?}",
                completed(&repo).iter().map(HashSet::len).sum::<usize>()
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.cancel();
    run.await.expect("relay task").expect("relay run");
    let not_completed: Vec<_> = repo
        .rows()
        .into_iter()
        .filter(|r| r.status != Status::Completed)
        .collect();
    assert!(not_completed.is_empty(), "{not_completed:?}");

    // A plain consumer of the new broker.
    let records = read_topic_at(&bootstrap, &topic).await;
    let mut per_key: BTreeMap<usize, Vec<(i32, i64, usize)>> = BTreeMap::new();
    for r in &records {
        let (k, i) = key_index(r.value.as_deref().expect("a value"));
        assert_eq!(
            r.key.as_deref(),
            Some(format!("k{k}").as_bytes()),
            "record key = partition key"
        );
        per_key
            .entry(k)
            .or_default()
            .push((r.partition, r.offset, i));
    }
    let mut duplicates = 0;
    for (k, open) in first_open.iter().copied().enumerate() {
        let got = per_key.remove(&k).unwrap_or_default();
        assert!(
            got.iter().all(|(p, _, _)| *p == got[0].0),
            "key k{k} spread over partitions: {got:?}"
        );
        // First deliveries, in offset order (one partition per key).
        let mut seen = HashSet::new();
        let mut firsts = Vec::new();
        for (_, _, i) in &got {
            if seen.insert(*i) {
                firsts.push(*i);
            } else {
                duplicates += 1;
            }
        }
        let start = firsts.first().copied().unwrap_or(PER_KEY);
        assert!(
            start <= open,
            "key k{k}: the new broker starts at event {start}, but the old one never acknowledged event {open}"
        );
        let want: Vec<usize> = (start..PER_KEY).collect();
        assert_eq!(
            firsts, want,
            "key k{k}: first deliveries on the new broker, in write order, gap-free"
        );
    }
    txoutbox_conformance::kafka::report(&format!(
        "K-19: idempotence {idempotence:?}; {done_at_kill} of {total} events acknowledged before the kill; \
         the new broker holds {} records ({} duplicates), every key in order",
        records.len(),
        duplicates
    ));
}
