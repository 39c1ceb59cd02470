//! The relay loop ([`Relay::run`], [`Relay::run_with`]): one cycle at a time, and what to do
//! between cycles.
//!
//! | after a cycle that… | the loop |
//! |---|---|
//! | fetched rows, broker reachable, breaker closed | starts the next cycle at once (R61) |
//! | fetched nothing | asks [`LoopHooks::on_idle`] whether to stop, then waits the idle wait (poll interval, doubling up to `idle_backoff_max`) or until woken ([`Relay::waker`]) |
//! | found the broker unreachable | waits out the outage: the poll interval (R61), or with [`RunOptions::outage_backoff`] `base`, `2·base`, … up to `cap`; it starts at once when the broker's connection comes back ([`Broker::reconnects`](crate::Broker::reconnects)) or its probe answers ([`Broker::probe`](crate::Broker::probe), every [`RunOptions::probe_interval`], each bounded by [`PROBE_TIMEOUT`]); once a cycle woken by the probe still found the broker unreachable, only a probe that failed and then answered wakes the loop in that outage, so a probe that answers while publishes fail cannot bring back a cycle per probe interval. Database wake-ups are ignored meanwhile: a writer's notification says nothing about the broker |
//! | kept from fetching by the open breaker | waits the poll interval or until woken |
//! | failed to fetch, transiently (database unreachable) | retries after [`RunOptions::repository_backoff`] (doubling up to its cap), forever |
//! | failed to fetch otherwise (table missing, permission denied, …) | retries likewise, and returns [`RunError::Repository`] after [`RunOptions::max_permanent_failures`] such failures in a row |
//!
//! Shutdown ends every wait at once and lets a cycle in flight finish (R60).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{CycleReport, Relay};
use crate::broker::{Probe, ReconnectWatch};
use crate::error::{ConfigError, RunError};

/// What [`LoopHooks::on_idle`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopControl {
    /// Keep running.
    Continue,
    /// Return `Ok(())` from the loop.
    Stop,
}

/// Hooks of the relay loop, for what a process around it adds (a summary line, a drain check).
/// Every method has a default that does nothing.
#[async_trait]
pub trait LoopHooks: Send + Sync {
    /// After every cycle that ran (its report; the breaker or shutdown may have kept it from
    /// fetching).
    async fn after_cycle(&self, _report: &CycleReport) {}

    /// After a cycle that fetched nothing, before the loop waits: [`LoopControl::Stop`] ends the
    /// loop with `Ok(())` (for example once the table is drained).
    async fn on_idle(&self) -> LoopControl {
        LoopControl::Continue
    }
}

struct NoHooks;

impl LoopHooks for NoHooks {}

/// An exponential wait: `base`, `2·base`, `4·base`, … up to `cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopBackoff {
    base: Duration,
    cap: Duration,
}

impl LoopBackoff {
    /// `base` > 0 and `cap` ≥ `base`, both at most one day.
    pub fn new(base: Duration, cap: Duration) -> Result<Self, ConfigError> {
        const DAY: Duration = Duration::from_secs(86_400);
        if base.is_zero() || base > DAY {
            return Err(ConfigError::new(format!(
                "loop backoff base must be > 0 and at most 1 day, got {base:?}"
            )));
        }
        if cap < base || cap > DAY {
            return Err(ConfigError::new(format!(
                "loop backoff cap must be >= its base ({base:?}) and at most 1 day, got {cap:?}"
            )));
        }
        Ok(Self { base, cap })
    }

    /// The wait after the `n`-th failure in a row (n ≥ 1).
    pub fn wait(&self, n: u32) -> Duration {
        let shift = n.saturating_sub(1).min(31);
        self.base.saturating_mul(1u32 << shift).min(self.cap)
    }

    /// The base.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The cap.
    pub fn cap(&self) -> Duration {
        self.cap
    }
}

/// Default of [`RunOptions::repository_backoff`]: 250 ms doubling up to 10 s.
pub const DEFAULT_REPOSITORY_BACKOFF: LoopBackoff = LoopBackoff {
    base: Duration::from_millis(250),
    cap: Duration::from_secs(10),
};
/// The outage back-off `outbox-relay` runs with (`--outage-backoff-base 1s`,
/// `--outage-backoff-cap 30s`): 1 s doubling up to 30 s. Pass it to
/// [`RunOptions::outage_backoff`]; the library's default stays R61's poll interval.
pub const RECOMMENDED_OUTAGE_BACKOFF: LoopBackoff = LoopBackoff {
    base: Duration::from_secs(1),
    cap: Duration::from_secs(30),
};
/// Default of [`RunOptions::max_permanent_failures`].
pub const DEFAULT_MAX_PERMANENT_FAILURES: u32 = 5;
/// Default of [`RunOptions::probe_interval`].
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_millis(250);
/// How long the loop waits for one [`Broker::probe`](crate::Broker::probe) to answer; a probe
/// that takes longer counts as [`Probe::Down`] (a black-holed broker answers nothing).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Settings of the loop (the cycle's are on [`RelayBuilder`](super::RelayBuilder)).
#[derive(Clone)]
pub struct RunOptions {
    outage: Option<LoopBackoff>,
    repository: LoopBackoff,
    max_permanent: u32,
    probe_interval: Duration,
    hooks: Arc<dyn LoopHooks>,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("outage", &self.outage)
            .field("repository", &self.repository)
            .field("max_permanent", &self.max_permanent)
            .field("probe_interval", &self.probe_interval)
            .finish_non_exhaustive()
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            outage: None,
            repository: DEFAULT_REPOSITORY_BACKOFF,
            max_permanent: DEFAULT_MAX_PERMANENT_FAILURES,
            probe_interval: DEFAULT_PROBE_INTERVAL,
            hooks: Arc::new(NoHooks),
        }
    }
}

impl RunOptions {
    /// The defaults: R61's outage wait (the poll interval), repository back-off 250 ms to 10 s,
    /// 5 permanent failures, probe every 250 ms, no hooks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits out a broker outage with an exponential back-off instead of the poll interval
    /// (issue 14: far fewer cycles and row writes during an outage). The broker's reconnection
    /// still starts the next cycle at once.
    pub fn outage_backoff(mut self, b: LoopBackoff) -> Self {
        self.outage = Some(b);
        self
    }

    /// The wait after a failed fetch (doubling per failure in a row).
    pub fn repository_backoff(mut self, b: LoopBackoff) -> Self {
        self.repository = b;
        self
    }

    /// How many non-transient fetch failures in a row end the loop with an error (≥ 1).
    pub fn max_permanent_failures(mut self, n: u32) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::new(
                "max_permanent_failures must be >= 1, got 0",
            ));
        }
        self.max_permanent = n;
        Ok(self)
    }

    /// How often [`Broker::probe`](crate::Broker::probe) is called while the loop waits out an
    /// outage (> 0).
    pub fn probe_interval(mut self, d: Duration) -> Result<Self, ConfigError> {
        if d.is_zero() {
            return Err(ConfigError::new("probe_interval must be > 0"));
        }
        self.probe_interval = d;
        Ok(self)
    }

    /// The hooks.
    pub fn hooks(mut self, h: Arc<dyn LoopHooks>) -> Self {
        self.hooks = h;
        self
    }
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woke {
    Timer,
    Signal,
    /// The broker's probe answered [`Probe::Up`].
    Probe,
    Shutdown,
}

/// How an outage pause calls [`Broker::probe`](crate::Broker::probe).
#[derive(Debug, Clone, Copy)]
struct ProbeWait {
    every: Duration,
    after_a_failure: bool,
}

impl Relay {
    /// Runs cycles until `shutdown` is cancelled, with the default [`RunOptions`]. See
    /// [`run_with`](Self::run_with).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), RunError> {
        self.run_with(shutdown, RunOptions::default()).await
    }

    /// Runs cycles until `shutdown` is cancelled or a hook stops it (`Ok`), or until fetching
    /// failed `max_permanent_failures` times in a row for a reason retrying cannot fix (`Err`).
    /// What the loop does between cycles is in the module docs; the loop tests of this module
    /// and conformance scenario T-11 check it.
    pub async fn run_with(
        &self,
        shutdown: CancellationToken,
        options: RunOptions,
    ) -> Result<(), RunError> {
        let poll = self.config.poll_interval;
        let worker = self.config.worker_id.to_string();
        let mut reconnects = self.broker.reconnects();
        let mut idle_wait = poll;
        let mut outages = 0u32;
        // Outage pauses ended by the probe, and whether one of them was in vain (the next cycle
        // found the broker unreachable again: the probe answers while publishing still fails,
        // say JetStream without its stream). From then on, in this outage, only a probe that
        // first failed and then answered ends a pause; otherwise the probe would bring back a
        // cycle every probe interval.
        let mut woken_by_probe = false;
        let mut probe_in_vain = false;
        let mut transient_failures = 0u32;
        let mut permanent_failures = 0u32;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            if let Some(r) = reconnects.as_mut() {
                r.mark_seen();
            }
            let span = tracing::info_span!(
                "outbox.cycle",
                worker.id = %worker,
                fetched = tracing::field::Empty,
                completed = tracing::field::Empty,
                failed = tracing::field::Empty,
            );
            let report = match self.cycle(&shutdown).instrument(span.clone()).await {
                Ok(r) => r,
                Err(e) => {
                    let (n, what) = if e.is_transient() {
                        permanent_failures = 0;
                        transient_failures += 1;
                        (transient_failures, "the database is unreachable")
                    } else {
                        transient_failures = 0;
                        permanent_failures += 1;
                        if permanent_failures >= options.max_permanent {
                            tracing::error!(%worker, error = %e, tries = permanent_failures, "fetch failed; stopping the relay");
                            return Err(RunError::Repository {
                                tries: permanent_failures,
                                source: e,
                            });
                        }
                        (permanent_failures, "fetch failed")
                    };
                    let wait = options.repository.wait(n);
                    tracing::warn!(%worker, error = %e, transient = e.is_transient(), tries = n, retry_in = ?wait, "{what}; waiting before the next fetch");
                    if matches!(
                        self.pause(wait, None, None, &shutdown).await,
                        Woke::Shutdown
                    ) {
                        return Ok(());
                    }
                    continue;
                }
            };
            transient_failures = 0;
            permanent_failures = 0;
            span.record("fetched", report.fetched.len());
            span.record("completed", report.completed.len());
            span.record("failed", report.counted.len() + report.transient.len());
            if !report.fetched.is_empty() {
                tracing::debug!(
                    parent: &span,
                    fetched = report.fetched.len(),
                    completed = report.completed.len(),
                    failed = report.counted.len() + report.transient.len(),
                    "cycle"
                );
            }
            options.hooks.after_cycle(&report).await;

            if report.broker_unreachable {
                outages += 1;
                if woken_by_probe && !probe_in_vain {
                    probe_in_vain = true;
                    tracing::debug!(%worker, "the broker answers its probe but still fails publishes; waking on the probe only after it failed once");
                }
                let wait = options.outage.map_or(poll, |b| b.wait(outages));
                if outages == 1 {
                    tracing::warn!(%worker, retry_in = ?wait, "broker unreachable; waiting for it (backing off)");
                } else {
                    tracing::debug!(%worker, outages, retry_in = ?wait, "broker still unreachable");
                }
                let probe = Some(ProbeWait {
                    every: options.probe_interval,
                    after_a_failure: probe_in_vain,
                });
                let woke = self
                    .pause(wait, reconnects.as_mut(), probe, &shutdown)
                    .await;
                woken_by_probe = woke == Woke::Probe;
                match woke {
                    Woke::Shutdown => return Ok(()),
                    Woke::Signal | Woke::Probe => {
                        tracing::info!(%worker, "broker reachable again; fetching")
                    }
                    Woke::Timer => {}
                }
                continue;
            }
            woken_by_probe = false;
            probe_in_vain = false;
            if !report.fetched.is_empty() && !report.breaker_open {
                if outages > 0 {
                    tracing::info!(%worker, "broker reachable again");
                }
                outages = 0;
                idle_wait = poll;
                continue;
            }
            let idle = report.fetched.is_empty() && !report.breaker_open;
            if idle {
                outages = 0;
                if options.hooks.on_idle().await == LoopControl::Stop {
                    return Ok(());
                }
            }
            let wait = if idle { idle_wait } else { poll };
            match self.pause_wakeable(wait, &shutdown).await {
                Woke::Shutdown => return Ok(()),
                Woke::Signal | Woke::Probe => idle_wait = poll,
                Woke::Timer => {
                    if idle {
                        idle_wait = idle_wait
                            .saturating_mul(2)
                            .min(self.config.idle_backoff_max);
                    }
                }
            }
        }
    }

    /// Waits `wait`, or until the relay's waker fires, or shutdown.
    async fn pause_wakeable(&self, wait: Duration, shutdown: &CancellationToken) -> Woke {
        tokio::select! {
            _ = tokio::time::sleep(wait) => Woke::Timer,
            _ = self.wake.notified() => Woke::Signal,
            _ = shutdown.cancelled() => Woke::Shutdown,
        }
    }

    /// Waits `wait`, or until the broker is back (its reconnection counter moves, or its probe,
    /// called every `probe.every`, answers within [`PROBE_TIMEOUT`]; with
    /// `probe.after_a_failure`, only an answer after a failed probe counts), or shutdown. The
    /// relay's waker is not listened to.
    async fn pause(
        &self,
        wait: Duration,
        reconnects: Option<&mut ReconnectWatch>,
        probe: Option<ProbeWait>,
        shutdown: &CancellationToken,
    ) -> Woke {
        let reconnected = async {
            match reconnects {
                Some(r) => r.changed().await,
                None => std::future::pending().await,
            }
        };
        let probed = async {
            let Some(ProbeWait {
                every,
                after_a_failure,
            }) = probe
            else {
                return std::future::pending().await;
            };
            let mut failed = !after_a_failure;
            loop {
                tokio::time::sleep(every).await;
                match tokio::time::timeout(PROBE_TIMEOUT, self.broker.probe()).await {
                    Ok(Probe::Up) if failed => return,
                    Ok(Probe::Up) => {}
                    Ok(Probe::Down) | Err(_) => failed = true,
                    Ok(Probe::Unsupported) => return std::future::pending().await,
                }
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => Woke::Timer,
            _ = reconnected => Woke::Signal,
            _ = probed => Woke::Probe,
            _ = shutdown.cancelled() => Woke::Shutdown,
        }
    }
}

#[cfg(test)]
mod tests {
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
    }

    fn flaky(
        inner: InMemoryRepository,
        failures: u32,
        fail: fn() -> RepositoryError,
    ) -> Arc<Flaky> {
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

    /// 3 relays (the setting) share one table of 600 rows on 200 keys; the broker is
    /// down for 10 s and then comes back; the loop runs with `options`, `poll` as the poll
    /// interval.
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

    /// Issue 14's figure: the ancestor made 46,060 row updates with 3 relays during a 10 s broker
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
        let backoff =
            LoopBackoff::new(Duration::from_millis(500), Duration::from_secs(30)).unwrap();
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
            (Duration::from_secs(4)..Duration::from_millis(4_500))
                .contains(&with.first_publish_after),
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
}
