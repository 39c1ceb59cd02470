//! The database outage trial on a live broker (issue 28): a runner on a real subscription and
//! a real database whose connections go through a local proxy ([`LoopbackProxy`]); the trial
//! cuts the proxy for [`OUTAGE`] while messages keep coming, so the runner sees the database go
//! away and come back without the server being touched. Two faults ([`DbFault`]): refused
//! connections (a server that is down: a pool keeps trying to connect until its acquire
//! timeout) and reset ones (every connection, open or new, reset at once: each transaction
//! fails at once, as behind a pooler whose server restarts).
//!
//! What it checks (R120, R132, R166): every message is handled exactly once (its row
//! `completed`, at most one committed `completed` result, and a committed result of each: a
//! transaction whose commit the cut interrupted may have committed, and its redelivery is then a
//! `duplicate`), each key's `completed` results come in publish order, and no message completes later than [`MAX_DELAY`] after the database is back
//! (or after its publish, when that is later). A runner that keeps reading while the database
//! is away gives back more than a broker lets wait (Redis keeps at most `concurrency` rewinds
//! waiting, R136), and the rest wait for the broker's own redelivery ([`REDELIVER_AFTER`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Instant;

use txoutbox_core::inbox::repository::InboxBackend;
use txoutbox_core::inbox::{
    DeliveryResult, Handler, HandlerError, HandlerOutcome, InboxEvent, InboxHooks,
};

use super::*;
use crate::broker::LoopbackProxy;

/// How the trial cuts the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbFault {
    /// Every connection cut, new ones refused.
    Refuse,
    /// Every connection, open or new, reset with a TCP RST.
    Reset,
}

/// How long the trial cuts the database.
pub const OUTAGE: Duration = Duration::from_secs(3);
/// The longest a message may complete after the database is back (or after its publish).
pub const MAX_DELAY: Duration = Duration::from_secs(5);
/// The subscription's own redelivery time (NATS ack_wait, Redis claim_idle, …): far beyond
/// [`MAX_DELAY`], so that a message left to it fails the trial.
pub const REDELIVER_AFTER: Duration = Duration::from_secs(60);
/// The runner's concurrency (and so Redis's bound on waiting rewinds, R136).
pub const CONCURRENCY: usize = 8;
const KEYS: usize = 8;
const PER_KEY: usize = 60;
/// One message every 10 ms: about 4.8 s of publishing, the cut after 1.0 s of it.
const EVERY: Duration = Duration::from_millis(10);
const CUT_AFTER: Duration = Duration::from_secs(1);
/// How long the trial waits for the last message after the database is back.
const SETTLE: Duration = Duration::from_secs(150);

/// The database of [`database_outage`]: a fresh inbox whose connections go to a local port
/// that the trial's proxy forwards to the server.
#[async_trait]
pub trait OutageDatabase: Send + Sync {
    /// The inbox backend.
    type Backend: InboxBackend;
    /// The server's `host:port`, which the trial's proxy forwards to.
    fn server(&self) -> String;
    /// A fresh, empty inbox whose connections go to `through` (the proxy); what it
    /// needs (a schema, a pool) lives as long as `self`.
    async fn inbox(&self, through: SocketAddr) -> Self::Backend;
}

/// What a [`database_outage`] trial measured.
#[derive(Debug, Clone)]
pub struct DatabaseOutageFigures {
    /// The broker (the subscription's name).
    pub broker: &'static str,
    /// The fault.
    pub fault: DbFault,
    /// Messages published.
    pub messages: usize,
    /// The longest from the database's return (or the message's publish, when later) to the
    /// message's completion, and that message.
    pub max_delay: Duration,
    /// The message of `max_delay`.
    pub slowest: String,
    /// Messages published before the database came back that completed after it.
    pub caught_by_outage: usize,
    /// Delivery results `persist_failed`.
    pub persist_failures: usize,
    /// Delivery results in all.
    pub deliveries: usize,
    /// From the database's return to the last completion.
    pub drained_after: Duration,
}

impl fmt::Display for DatabaseOutageFigures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "database outage ({:?}) on {}: {} messages, {:?} outage; max delay after the database came back {:.3} s ({}); \
             {} messages waited for it; persist_failed results {}; delivery results {}; drained {:.3} s after",
            self.fault,
            self.broker,
            self.messages,
            OUTAGE,
            self.max_delay.as_secs_f64(),
            self.slowest,
            self.caught_by_outage,
            self.persist_failures,
            self.deliveries,
            self.drained_after.as_secs_f64()
        )
    }
}

/// Completes every row after 2 ms of work, in any backend's transaction.
struct Work;

#[async_trait]
impl<T: Send> Handler<T> for Work {
    async fn handle(&self, _row: &InboxEvent, _tx: &mut T) -> Result<HandlerOutcome, HandlerError> {
        tokio::time::sleep(Duration::from_millis(2)).await;
        Ok(HandlerOutcome::completed())
    }
}

/// The runner's results with their times.
#[derive(Default)]
struct Log {
    results: Mutex<Vec<(Instant, DeliveryResult)>>,
}

impl InboxHooks for Log {
    fn on_delivery(&self, r: &DeliveryResult) {
        self.results
            .lock()
            .expect("poisoned")
            .push((Instant::now(), r.clone()));
    }
    fn on_persist_failure(&self, r: &DeliveryResult) {
        self.on_delivery(r);
    }
}

impl Log {
    /// Committed `completed` results: (when, message_id).
    fn completed(&self) -> Vec<(Instant, String)> {
        self.committed(&[O::Completed])
    }

    /// Committed results of these outcomes: (when, message_id).
    fn committed(&self, outcomes: &[O]) -> Vec<(Instant, String)> {
        self.results
            .lock()
            .expect("poisoned")
            .iter()
            .filter(|(_, r)| outcomes.contains(&r.outcome) && r.committed)
            .filter_map(|(t, r)| r.message_id.clone().map(|m| (*t, m)))
            .collect()
    }

    /// Messages with a committed `completed` or `duplicate` result: a transaction whose
    /// commit the cut interrupted may have committed, and then its redelivery is a duplicate.
    fn done(&self) -> HashMap<String, Instant> {
        let mut m = HashMap::new();
        for (t, id) in self.committed(&[O::Completed, O::Duplicate]) {
            m.entry(id).or_insert(t);
        }
        m
    }
}

fn id_of(k: usize, n: usize) -> String {
    format!("o{k}-{n}")
}

/// The trial (see the module docs): one runner (concurrency [`CONCURRENCY`], a subscription
/// whose own redelivery takes [`REDELIVER_AFTER`]) handles 8 keys × 60 messages
/// published one every 10 ms; 1 s in, the database is cut for [`OUTAGE`] by `fault`. Panics, with the
/// figures, when a message is lost, handled twice, out of its key's order or later than
/// [`MAX_DELAY`]; returns the figures.
pub async fn database_outage<S, D>(s: &S, db: &D, fault: DbFault) -> DatabaseOutageFigures
where
    S: SubscriptionUnderTest + ?Sized,
    D: OutageDatabase,
{
    let trial = s.trial().await;
    let server = tokio::net::lookup_host(db.server())
        .await
        .expect("resolve the database server")
        .next()
        .expect("the database server has an address");
    let proxy = LoopbackProxy::start(server).await;
    let backend = db.inbox(proxy.addr()).await;
    let sub = trial.subscription("w1", REDELIVER_AFTER).await;
    let broker = sub.capabilities().name;
    let log = Arc::new(Log::default());
    let runner = Arc::new(
        Runner::builder(backend.clone(), sub, "g")
            .worker_id("w1")
            .handler(Arc::new(Work))
            .process_stored(false)
            .sources(["src"])
            .messages_per_transaction(1)
            .concurrency(CONCURRENCY)
            .hooks(log.clone())
            .random_source(Box::new(SeededRng::new(7)))
            .build()
            .expect("runner builds"),
    );
    runner.start();
    let task = tokio::spawn({
        let r = runner.clone();
        async move { r.run_until_stopped().await.expect("runner runs") }
    });

    let total = KEYS * PER_KEY;
    let started = tokio::time::Instant::now();
    let publish = async {
        let mut at = HashMap::new();
        for i in 0..total {
            tokio::time::sleep_until(started + EVERY * i as u32).await;
            let (k, n) = (i % KEYS, i / KEYS);
            let (id, key) = (id_of(k, n), format!("k{k}"));
            let body = json!({"key": key, "n": n}).to_string();
            trial
                .publish(
                    &[
                        ("event_id", &id),
                        ("topic", "src"),
                        ("event_type", "e"),
                        ("partition_key", &key),
                    ],
                    &body,
                )
                .await;
            at.insert(id, Instant::now());
        }
        at
    };
    let cut = async {
        tokio::time::sleep_until(started + CUT_AFTER).await;
        match fault {
            DbFault::Refuse => proxy.close().await,
            DbFault::Reset => proxy.reset(),
        }
        tokio::time::sleep(OUTAGE).await;
        match fault {
            DbFault::Refuse => proxy.reopen().await,
            DbFault::Reset => proxy.stop_resetting(),
        }
        Instant::now()
    };
    let (published, back) = tokio::join!(publish, cut);

    let deadline = back + SETTLE;
    while log.done().len() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    runner.stop();
    let _ = task.await;

    let completed = log.completed();
    let mut times: HashMap<String, Vec<Instant>> = HashMap::new();
    for (t, id) in &completed {
        times.entry(id.clone()).or_default().push(*t);
    }
    let done_at = log.done();
    let mut max_delay = Duration::ZERO;
    let mut slowest = String::new();
    let mut caught = 0;
    let mut last = back;
    for (id, done) in &done_at {
        let from = published.get(id).copied().unwrap_or(back).max(back);
        let done = *done;
        last = last.max(done);
        if published.get(id).is_some_and(|p| *p < back) && done > back {
            caught += 1;
        }
        let d = done.saturating_duration_since(from);
        if d > max_delay {
            max_delay = d;
            slowest = id.clone();
        }
    }
    let results = log.results.lock().expect("poisoned").len();
    let persist_failures = log
        .results
        .lock()
        .expect("poisoned")
        .iter()
        .filter(|(_, r)| r.outcome == O::PersistFailed)
        .count();
    let figures = DatabaseOutageFigures {
        broker,
        fault,
        messages: total,
        max_delay,
        slowest,
        caught_by_outage: caught,
        persist_failures,
        deliveries: results,
        drained_after: last.saturating_duration_since(back),
    };

    // Every message once, each key in publish order.
    let missing: Vec<String> = (0..KEYS)
        .flat_map(|k| (0..PER_KEY).map(move |n| id_of(k, n)))
        .filter(|id| !done_at.contains_key(id))
        .collect();
    let twice: Vec<&String> = times
        .iter()
        .filter(|(_, ts)| ts.len() > 1)
        .map(|(id, _)| id)
        .collect();
    let mut order: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (_, id) in &completed {
        let (k, n) = id[1..].split_once('-').expect("o{k}-{n}");
        order
            .entry(k.parse().expect("k"))
            .or_default()
            .push(n.parse().expect("n"));
    }
    let out_of_order: Vec<usize> = order
        .iter()
        .filter(|(_, ns)| ns.windows(2).any(|w| w[0] >= w[1]))
        .map(|(k, _)| *k)
        .collect();
    let mut not_completed = Vec::new();
    for id in done_at.keys() {
        let row = backend
            .get_by_message_id(id, &g())
            .await
            .expect("read the inbox row");
        if row.map(|r| r.status) != Some(Status::Completed) {
            not_completed.push(id.clone());
        }
    }
    proxy.shutdown().await;
    trial.cleanup().await;
    assert!(
        missing.is_empty(),
        "{figures}; not completed within {SETTLE:?} after the database came back: {missing:?}"
    );
    assert!(twice.is_empty(), "{figures}; completed twice: {twice:?}");
    assert!(
        not_completed.is_empty(),
        "{figures}; rows not completed: {not_completed:?}"
    );
    assert!(
        out_of_order.is_empty(),
        "{figures}; keys completed out of publish order: {out_of_order:?} ({order:?})"
    );
    assert!(
        figures.max_delay <= MAX_DELAY,
        "{figures}; a message completed more than {MAX_DELAY:?} after the database came back"
    );
    figures
}
