//! The loop's tests: waits, outage back-off, probes, fetch errors, shutdown, on a paused clock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use uuid::Uuid;

use super::*;
use crate::broker::{Ack, Broker, Message, ReconnectSignal};
use crate::clock::Clock;
use crate::error::{BrokerError, RepositoryError};
use crate::event::{NewEvent, OutboxEvent, WorkerId};
use crate::memory::InMemoryRepository;
use crate::repository::{
    BlockedKey, Capabilities, FetchRequest, Fetched, OutboxRepository, Outcome, StatusCount,
    WrittenOutcome,
};
use crate::scripted::{Action, ScriptedBroker};
use crate::step::PipelineStep;

/// Wall time that moves with tokio's (paused) clock.
#[derive(Debug)]
struct TokioWall {
    utc: DateTime<Utc>,
    at: Instant,
}

impl Clock for TokioWall {
    fn now(&self) -> DateTime<Utc> {
        self.utc + chrono::Duration::from_std(self.at.elapsed()).unwrap()
    }
}

fn memory() -> InMemoryRepository {
    InMemoryRepository::new(Arc::new(TokioWall {
        utc: Utc::now(),
        at: Instant::now(),
    }))
}

async fn put(repo: &InMemoryRepository, keys: usize, per_key: usize) -> Vec<Uuid> {
    let mut events = Vec::new();
    for i in 0..per_key {
        for k in 0..keys {
            events.push(
                NewEvent::builder()
                    .event_type("t")
                    .aggregate("a", Uuid::new_v4())
                    .topic("orders")
                    .partition_key(format!("k{k}"))
                    .payload_json(serde_json::json!({ "i": i }))
                    .build()
                    .unwrap(),
            );
        }
    }
    repo.write_committed(events)
        .await
        .unwrap()
        .iter()
        .map(|w| w.event.id)
        .collect()
}

/// A repository whose fetch fails with `fail()` while `failures_left` > 0.
struct Flaky {
    inner: InMemoryRepository,
    failures_left: AtomicU32,
    fail: fn() -> RepositoryError,
    fetches: Mutex<Vec<Instant>>,
}

#[async_trait]
impl OutboxRepository for Flaky {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        self.inner.now().await
    }
    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError> {
        self.inner.get(id).await
    }
    async fn fetch_and_lock(&self, r: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError> {
        self.fetches.lock().unwrap().push(Instant::now());
        let left = self.failures_left.load(Ordering::SeqCst);
        if left > 0 {
            self.failures_left.store(left - 1, Ordering::SeqCst);
            return Err((self.fail)());
        }
        self.inner.fetch_and_lock(r).await
    }
    async fn write_outcomes(
        &self,
        w: &WorkerId,
        o: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        self.inner.write_outcomes(w, o).await
    }
    async fn refresh_lock(&self, id: Uuid, w: &WorkerId) -> Result<bool, RepositoryError> {
        self.inner.refresh_lock(id, w).await
    }
    async fn release_lock(&self, id: Uuid, w: &WorkerId) -> Result<bool, RepositoryError> {
        self.inner.release_lock(id, w).await
    }
    async fn release_locks(&self, ids: &[Uuid], w: &WorkerId) -> Result<u64, RepositoryError> {
        self.inner.release_locks(ids, w).await
    }
    async fn release_stale_locks(&self, t: Duration) -> Result<u64, RepositoryError> {
        self.inner.release_stale_locks(t).await
    }
    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        self.inner.requeue_failed(id).await
    }
    async fn delete_old_completed(&self, d: u32, b: usize) -> Result<u64, RepositoryError> {
        self.inner.delete_old_completed(d, b).await
    }
    async fn force_unlock(&self, id: Uuid, r: &str) -> Result<(), RepositoryError> {
        self.inner.force_unlock(id, r).await
    }
    async fn blocked_keys(
        &self,
        l: Duration,
        n: usize,
    ) -> Result<Vec<BlockedKey>, RepositoryError> {
        self.inner.blocked_keys(l, n).await
    }
    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError> {
        self.inner.counts().await
    }
    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError> {
        self.inner.oldest_due_age().await
    }
    async fn parked_rows(&self) -> Result<u64, RepositoryError> {
        self.inner.parked_rows().await
    }
}

fn flaky(inner: InMemoryRepository, failures: u32, fail: fn() -> RepositoryError) -> Arc<Flaky> {
    Arc::new(Flaky {
        inner,
        failures_left: AtomicU32::new(failures),
        fail,
        fetches: Mutex::new(Vec::new()),
    })
}

fn secs_since(t0: Instant, v: &[Instant]) -> Vec<f64> {
    v.iter()
        .map(|t| ((*t - t0).as_secs_f64() * 1000.0).round() / 1000.0)
        .collect()
}

fn completed(repo: &InMemoryRepository) -> usize {
    repo.rows()
        .iter()
        .filter(|r| r.status == crate::Status::Completed)
        .count()
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_database_is_retried_with_backoff_and_the_loop_goes_on() {
    let mem = memory();
    put(&mem, 3, 1).await;
    let repo = flaky(mem.clone(), 4, || RepositoryError::Unavailable {
        message: "connection refused".into(),
    });
    let relay = Relay::builder(repo.clone(), Arc::new(ScriptedBroker::new()))
        .worker_id("w")
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let t0 = Instant::now();
    let run = relay.run(stop.clone());
    let drive = async {
        tokio::time::sleep(Duration::from_secs(20)).await;
        stop.cancel();
    };
    let (res, ()) = tokio::join!(run, drive);
    res.expect("a transient fetch error never ends the loop");
    let times = secs_since(t0, &repo.fetches.lock().unwrap());
    // Waits 0.25, 0.5, 1, 2 after the four failures, then the fetch with rows, the empty
    // fetch, and the poll interval (5 s) after it.
    assert_eq!(
        times,
        [0.0, 0.25, 0.75, 1.75, 3.75, 3.75, 8.75, 13.75, 18.75]
    );
    assert_eq!(completed(&mem), 3);
}

#[tokio::test(start_paused = true)]
async fn a_missing_table_ends_the_loop_after_the_bounded_tries() {
    let mem = memory();
    let repo = flaky(mem, u32::MAX, || {
        RepositoryError::Schema("relation \"outbox_events\" does not exist".into())
    });
    let relay = Relay::builder(repo.clone(), Arc::new(ScriptedBroker::new()))
        .worker_id("w")
        .build()
        .unwrap();
    let t0 = Instant::now();
    let err = relay
        .run_with(
            CancellationToken::new(),
            RunOptions::new().max_permanent_failures(3).unwrap(),
        )
        .await
        .expect_err("a missing table ends the loop");
    assert!(
        matches!(
            &err,
            RunError::Repository {
                tries: 3,
                source: RepositoryError::Schema(_)
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("run the migrations"), "{err}");
    // Three tries, 0.25 s and 0.5 s apart; no wait after the last.
    assert_eq!(
        secs_since(t0, &repo.fetches.lock().unwrap()),
        [0.0, 0.25, 0.75]
    );
    assert_eq!(t0.elapsed(), Duration::from_millis(750));
}

#[tokio::test(start_paused = true)]
async fn a_success_resets_the_count_of_permanent_failures() {
    // 4 failures, a success, 4 failures, ...: with max 5 the loop never ends.
    struct Pattern(AtomicU32);
    let mem = memory();
    let repo = flaky(mem, 4, || {
        RepositoryError::Other("permission denied".into())
    });
    let relay = Relay::builder(repo.clone(), Arc::new(ScriptedBroker::new()))
        .worker_id("w")
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let pattern = Pattern(AtomicU32::new(0));
    let drive = async {
        for _ in 0..3 {
            // Wait until the four failures are spent and one success ran, then re-arm.
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if repo.failures_left.load(Ordering::SeqCst) == 0
                    && repo.fetches.lock().unwrap().len() as u32
                        > pattern.0.load(Ordering::SeqCst) + 4
                {
                    break;
                }
            }
            pattern
                .0
                .store(repo.fetches.lock().unwrap().len() as u32, Ordering::SeqCst);
            repo.failures_left.store(4, Ordering::SeqCst);
        }
        stop.cancel();
    };
    let (res, ()) = tokio::join!(relay.run(stop.clone()), drive);
    res.expect("never five permanent failures in a row");
    assert!(repo.fetches.lock().unwrap().len() >= 15);
}

/// How the test broker answers [`Broker::probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProbeMode {
    /// No probe.
    None,
    /// `Up` when up, `Down` when down.
    Honest,
    /// Always `Up`, while publishes fail (JetStream without its stream, say).
    AlwaysUp,
    /// A probe sent while down is never answered (lost in a black-holed network); one
    /// sent while up answers `Up`.
    LostWhileDown,
}

/// A broker that is down until `up` is set; with `signal`, it reports reconnections, and
/// it answers probes as `probe` says.
struct Outage {
    inner: ScriptedBroker,
    up: AtomicBool,
    signal: Option<ReconnectSignal>,
    probe: ProbeMode,
    probes: AtomicU32,
}

impl Outage {
    fn new(signal: bool, probe: ProbeMode) -> Arc<Self> {
        Arc::new(Self {
            inner: ScriptedBroker::new(),
            up: AtomicBool::new(false),
            signal: signal.then(ReconnectSignal::new),
            probe,
            probes: AtomicU32::new(0),
        })
    }

    fn come_back(&self) {
        self.up.store(true, Ordering::SeqCst);
        if let Some(s) = &self.signal {
            s.connected();
        }
    }
}

#[async_trait]
impl Broker for Outage {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        if !self.up.load(Ordering::SeqCst) {
            self.inner
                .set_default(Action::Transient("connection refused".into()));
        } else {
            self.inner.set_default(Action::Ok);
        }
        self.inner.publish(m).await
    }
    fn reconnects(&self) -> Option<crate::broker::ReconnectWatch> {
        self.signal.as_ref().map(ReconnectSignal::watch)
    }
    async fn probe(&self) -> Probe {
        if self.probe == ProbeMode::None {
            return Probe::Unsupported;
        }
        self.probes.fetch_add(1, Ordering::SeqCst);
        match self.probe {
            ProbeMode::AlwaysUp => Probe::Up,
            ProbeMode::LostWhileDown => {
                if !self.up.load(Ordering::SeqCst) {
                    // The request went into the black hole: no answer, ever.
                    std::future::pending::<()>().await;
                }
                Probe::Up
            }
            _ if self.up.load(Ordering::SeqCst) => Probe::Up,
            _ => Probe::Down,
        }
    }
}

/// Rows fetched per cycle, with the cycle's start.
struct Fetches(Mutex<Vec<(Instant, usize)>>);

#[async_trait]
impl PipelineStep for Fetches {
    async fn on_fetch(&self, rows: usize) {
        self.0.lock().unwrap().push((Instant::now(), rows));
    }
}

struct Outcome10s {
    /// Cycles that fetched rows during the 10 s outage.
    cycles: usize,
    /// Row writes during the outage: each fetched row is leased, then released or deferred.
    row_writes: usize,
    /// From the broker's return to its first acknowledgement.
    first_publish_after: Duration,
}

/// 3 relays (the setting the ancestor was measured in) share one table of 600 rows on 200
/// keys; the broker is down for 10 s and then comes back; the loop runs with `options`, `poll`
/// as the poll interval.
async fn outage_10s(broker: Arc<Outage>, poll: Duration, options: RunOptions) -> Outcome10s {
    let mem = memory();
    put(&mem, 200, 3).await;
    let fetches = Arc::new(Fetches(Mutex::new(Vec::new())));
    let stop = CancellationToken::new();
    let t0 = Instant::now();
    let relays: Vec<Relay> = (0..3)
        .map(|i| {
            Relay::builder(Arc::new(mem.clone()), broker.clone())
                .worker_id(format!("w{i}"))
                .poll_interval(poll)
                .step(fetches.clone())
                .build()
                .unwrap()
        })
        .collect();
    let wakers: Vec<_> = relays.iter().map(Relay::waker).collect();
    let loops = futures::future::join_all(
        relays
            .iter()
            .map(|r| r.run_with(stop.clone(), options.clone())),
    );
    let drive = async {
        // Writers keep notifying during the outage: the loops must not cycle on it.
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            wakers.iter().for_each(|w| w.notify_one());
        }
        broker.come_back();
        broker
            .inner
            .wait_for_calls(|c| c.iter().any(|c| matches!(c.result, Some(Ok(())))))
            .await;
        let first = Instant::now() - (t0 + Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(30)).await;
        stop.cancel();
        first
    };
    let (results, first) = tokio::join!(loops, drive);
    for r in results {
        r.unwrap();
    }
    assert_eq!(
        completed(&mem),
        600,
        "everything is published after the outage"
    );
    let log = fetches.0.lock().unwrap();
    let during: Vec<_> = log
        .iter()
        .filter(|(t, n)| *t < t0 + Duration::from_secs(10) && *n > 0)
        .collect();
    Outcome10s {
        cycles: during.len(),
        row_writes: during.iter().map(|(_, n)| 2 * n).sum(),
        first_publish_after: first,
    }
}

/// The measured figure: the ancestor made 46,060 row updates with 3 relays during a 10 s broker
/// outage (measured from PostgreSQL's WAL); the target is at most 10 % of it.
const ANCESTOR_ROW_UPDATES_10S: usize = 46_060;

/// The loop as it was (a cycle every 0.2 s, the binary's `--until-drained` wait) against
/// the outage back-off (1 s doubling to 30 s) with a broker that reports its reconnection.
#[tokio::test(start_paused = true)]
async fn outage_backoff_cuts_cycles_and_writes_and_a_reconnect_wakes_the_loop() {
    let reference = outage_10s(
        Outage::new(false, ProbeMode::None),
        Duration::from_millis(200),
        RunOptions::new(),
    )
    .await;
    let backoff = LoopBackoff::new(Duration::from_secs(1), Duration::from_secs(30)).unwrap();
    let with = outage_10s(
        Outage::new(true, ProbeMode::None),
        Duration::from_millis(200),
        RunOptions::new().outage_backoff(backoff),
    )
    .await;
    eprintln!(
        "10 s outage, 3 relays: cycles {} -> {}, row writes {} -> {} (ancestor {}), first publish after the broker's return {:?} -> {:?}",
        reference.cycles,
        with.cycles,
        reference.row_writes,
        with.row_writes,
        ANCESTOR_ROW_UPDATES_10S,
        reference.first_publish_after,
        with.first_publish_after
    );
    assert!(reference.cycles >= 120, "{}", reference.cycles);
    // Back-off waits 1, 2, 4 s: cycles at 0, 1, 3 and 7 s per relay.
    assert_eq!(with.cycles, 3 * 4);
    assert!(with.cycles * 10 <= reference.cycles, "{}", with.cycles);
    assert!(
        with.row_writes * 10 <= reference.row_writes,
        "{}",
        with.row_writes
    );
    assert!(with.row_writes * 10 <= ANCESTOR_ROW_UPDATES_10S);
    // The next timer would fire at 15 s; the reconnection wakes the loops at once.
    assert!(
        with.first_publish_after < Duration::from_millis(10),
        "{:?}",
        with.first_publish_after
    );
}

/// The same with the default poll interval (5 s, a relay without `--until-drained`): the
/// outage waits do not depend on it, and the reconnection still wakes the loops at once
/// (before, nothing woke them: the first publish came up to a poll interval late).
#[tokio::test(start_paused = true)]
async fn outage_backoff_with_the_default_poll_interval() {
    let backoff = LoopBackoff::new(Duration::from_secs(1), Duration::from_secs(30)).unwrap();
    let with = outage_10s(
        Outage::new(true, ProbeMode::None),
        crate::relay::DEFAULT_POLL_INTERVAL,
        RunOptions::new().outage_backoff(backoff),
    )
    .await;
    assert_eq!(with.cycles, 3 * 4);
    assert!(with.row_writes * 10 <= ANCESTOR_ROW_UPDATES_10S);
    assert!(
        with.first_publish_after < Duration::from_millis(10),
        "{:?}",
        with.first_publish_after
    );
}

#[tokio::test(start_paused = true)]
async fn without_reconnect_events_the_probe_wakes_the_loop() {
    let broker = Outage::new(false, ProbeMode::Honest);
    let backoff = LoopBackoff::new(Duration::from_millis(500), Duration::from_secs(30)).unwrap();
    let with = outage_10s(
        broker.clone(),
        Duration::from_secs(5),
        RunOptions::new().outage_backoff(backoff),
    )
    .await;
    assert!(with.cycles <= 3 * 6, "{}", with.cycles);
    assert!(
        with.first_publish_after <= DEFAULT_PROBE_INTERVAL,
        "{:?}",
        with.first_publish_after
    );
    assert!(broker.probes.load(Ordering::SeqCst) > 0);
}

/// A probe that answers while publishes still fail wakes the loop once per outage, not
/// once per probe interval: after that wasted cycle only a probe that failed and then
/// answered counts, and this one never fails, so the back-off timer rules.
#[tokio::test(start_paused = true)]
async fn a_probe_that_answers_while_publishes_fail_does_not_bring_back_a_cycle_per_probe() {
    let broker = Outage::new(false, ProbeMode::AlwaysUp);
    let with = outage_10s(
        broker.clone(),
        Duration::from_secs(5),
        RunOptions::new().outage_backoff(RECOMMENDED_OUTAGE_BACKOFF),
    )
    .await;
    // Per relay: the first cycle at 0, the probe's at 0.25 s, then the timer's at 2.25 and
    // 6.25 s; without the guard, a cycle every 0.25 s (40 per relay).
    assert_eq!(with.cycles, 3 * 4, "cycles during the outage");
    assert!(with.row_writes * 10 <= ANCESTOR_ROW_UPDATES_10S);
    assert!(broker.probes.load(Ordering::SeqCst) > 3 * 4);
    // Nothing tells the loops the broker is back but the timer (at 14.25 s).
    assert!(
        (Duration::from_secs(4)..Duration::from_millis(4_500)).contains(&with.first_publish_after),
        "{:?}",
        with.first_publish_after
    );
}

/// A black-holed broker answers no probe: each probe ends after [`PROBE_TIMEOUT`] as
/// `Down`, and the first probe after the network comes back wakes the loop, long before
/// its back-off timer (at 15 s).
#[tokio::test(start_paused = true)]
async fn a_probe_without_answer_times_out_and_the_first_answer_wakes_the_loop() {
    let broker = Outage::new(false, ProbeMode::LostWhileDown);
    let with = outage_10s(
        broker.clone(),
        Duration::from_secs(5),
        RunOptions::new().outage_backoff(RECOMMENDED_OUTAGE_BACKOFF),
    )
    .await;
    // The timer's cycles at 0, 1, 3 and 7 s per relay; no probe woke a loop during it.
    assert_eq!(with.cycles, 3 * 4, "cycles during the outage");
    assert!(
        with.first_publish_after
            <= PROBE_TIMEOUT + DEFAULT_PROBE_INTERVAL + Duration::from_millis(20),
        "{:?}",
        with.first_publish_after
    );
    // Each probe waited for PROBE_TIMEOUT: about one per 1.25 s (10 per relay over the
    // pauses at 0, 1, 3 and 7 s and the first after the return), not one per 0.25 s.
    let probes = broker.probes.load(Ordering::SeqCst);
    assert!((3 * 4..=3 * 11).contains(&probes), "{probes} probes");
}

#[tokio::test(start_paused = true)]
async fn the_default_outage_wait_is_the_poll_interval_and_a_reconnect_cuts_it_short() {
    let with = outage_10s(
        Outage::new(true, ProbeMode::None),
        Duration::from_secs(5),
        RunOptions::new(),
    )
    .await;
    // Cycles at 0 and 5 s (R61, T-11) for each relay, and at once when the broker is back.
    assert_eq!(with.cycles, 6);
    assert!(with.first_publish_after < Duration::from_millis(10));
}

#[tokio::test(start_paused = true)]
async fn an_idle_hook_stops_the_loop_once_drained() {
    struct Drained(InMemoryRepository, AtomicU32);
    #[async_trait]
    impl LoopHooks for Drained {
        async fn after_cycle(&self, r: &CycleReport) {
            self.1.fetch_add(r.completed.len() as u32, Ordering::SeqCst);
        }
        async fn on_idle(&self) -> LoopControl {
            if completed(&self.0) == 30 {
                LoopControl::Stop
            } else {
                LoopControl::Continue
            }
        }
    }
    let mem = memory();
    put(&mem, 10, 3).await;
    let hooks = Arc::new(Drained(mem.clone(), AtomicU32::new(0)));
    let relay = Relay::builder(Arc::new(mem.clone()), Arc::new(ScriptedBroker::new()))
        .worker_id("w")
        .build()
        .unwrap();
    relay
        .run_with(
            CancellationToken::new(),
            RunOptions::new().hooks(hooks.clone()),
        )
        .await
        .unwrap();
    assert_eq!(hooks.1.load(Ordering::SeqCst), 30);
    assert_eq!(completed(&mem), 30);
}

#[test]
fn loop_backoff_doubles_to_its_cap_and_refuses_bad_settings() {
    let b = LoopBackoff::new(Duration::from_millis(500), Duration::from_secs(3)).unwrap();
    let waits: Vec<_> = (1..=5).map(|n| b.wait(n).as_millis()).collect();
    assert_eq!(waits, [500, 1000, 2000, 3000, 3000]);
    assert_eq!(b.wait(u32::MAX), Duration::from_secs(3));
    assert!(LoopBackoff::new(Duration::ZERO, Duration::from_secs(1)).is_err());
    assert!(LoopBackoff::new(Duration::from_secs(2), Duration::from_secs(1)).is_err());
    assert!(LoopBackoff::new(Duration::from_secs(1), Duration::MAX).is_err());
    assert!(RunOptions::new().max_permanent_failures(0).is_err());
    assert!(RunOptions::new().probe_interval(Duration::ZERO).is_err());
}
