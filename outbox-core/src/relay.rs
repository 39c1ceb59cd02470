//! The relay (contract sections 6 to 8 and D3 to D6): one worker running cycles against a
//! repository and a broker, in one of two delivery modes ([`DeliveryMode`]).
//!
//! One [`Relay::cycle`]:
//!
//! 1. reads the shutdown signal and the circuit breaker; either one stops the cycle before it
//!    fetches (R60, R62);
//! 2. **fetch**: heads of keys, extended into runs of up to `max_per_key` rows (R74). In the
//!    lease mode ([`DeliveryMode::Lease`], the default) the fetch stamps a lease and commits its
//!    own transaction at once (R76). In delivery in one transaction
//!    ([`DeliveryMode::Transaction`]) the fetch row-locks its rows without writing them, and
//!    its transaction stays open while the cycle publishes, bounded by a server timeout of
//!    2 × publish timeout plus a margin ([`RelayConfig::delivery_bound`], R84);
//! 3. **publish**: the runs of up to `publish_concurrency` keys at once, each key strictly one row
//!    after the other, waiting for each acknowledgement (R45, R75); in the lease mode no
//!    database transaction is open meanwhile. Before each publish the relay checks the shutdown
//!    signal, the stop flag and the time left (R49: the lease; in one transaction, no publish
//!    starts later than one publish timeout after the fetch), then runs the pipeline steps
//!    (R37). A rejection ends its key's run (R46); a transient failure or publish timeout ends
//!    its key's run and stops new publishes in the cycle, and the first unpublished row of every
//!    other key that had no failure is deferred (R47);
//! 4. **write outcomes**, guarded by the worker (R54, R55); rows that were not processed are
//!    released untouched (R77). In the lease mode the outcomes are one short second
//!    transaction; a transient failure of it is retried on a fresh one, waiting 25 ms doubling
//!    to 200 ms, while the lease lasts; only then do the rows wait out their lease (R57). In one
//!    transaction the outcomes are written in the fetch's transaction, which then commits: each
//!    row is written once, transient, deferred and released rows not at all, and a failed
//!    commit leaves every row free at once, to be published again (R84);
//! 5. after the commit, the observers of the pipeline steps (R68, R83).
//!
//! [`Relay::run`] loops cycles: at once after a cycle that fetched rows and found the broker
//! reachable, else after the poll interval or a wake-up (R61).
//!
//! The rooms: `relay/config.rs` (the builder and its validation), `breaker.rs` (the
//! circuit breaker, shared with the inbox runner and processor), `relay/cycle.rs` (one cycle: fetch, runs, decisions, outcome write,
//! observers), `relay/publish.rs` (one key's run: steps, publish, the outcome of each result),
//! `relay/run_loop.rs` (waits, outage back-off, which fetch errors end the loop); the report
//! types are in `report.rs`, shared with the pipeline steps' observers.
//!
//! [`DeliveryMode`]: crate::DeliveryMode
//! [`DeliveryMode::Lease`]: crate::DeliveryMode::Lease
//! [`DeliveryMode::Transaction`]: crate::DeliveryMode::Transaction

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::backoff::RandomSource;
use crate::broker::Broker;
use crate::clock::RelayClock;
use crate::repository::OutboxRepository;
use crate::step::PipelineStep;

mod config;
mod cycle;
mod publish;
mod run_loop;

use crate::breaker::Breaker;
pub use crate::breaker::BreakerConfig;
pub use crate::report::{CycleReport, FailureReport, RowOutcome};
pub use config::{
    DEFAULT_BATCH_SIZE, DEFAULT_POLL_INTERVAL, DEFAULT_PUBLISH_CONCURRENCY,
    DEFAULT_PUBLISH_TIMEOUT, MAX_PUBLISH_CONCURRENCY, MAX_TRANSACTION_PUBLISH_TIMEOUT,
    OUTCOME_RETRY_FIRST_WAIT, OUTCOME_RETRY_MAX_WAIT, RelayBuilder, RelayConfig,
    TRANSACTION_OUTCOME_MARGIN,
};
pub use run_loop::{
    DEFAULT_MAX_PERMANENT_FAILURES, DEFAULT_PROBE_INTERVAL, DEFAULT_REPOSITORY_BACKOFF,
    LoopBackoff, LoopControl, LoopHooks, PROBE_TIMEOUT, RECOMMENDED_OUTAGE_BACKOFF, RunOptions,
};

/// The relay: one worker running cycles against a repository and a broker.
pub struct Relay {
    repo: Arc<dyn OutboxRepository>,
    broker: Arc<dyn Broker>,
    steps: Vec<Arc<dyn PipelineStep>>,
    config: RelayConfig,
    rng: Mutex<Box<dyn RandomSource>>,
    clock: Arc<dyn RelayClock>,
    /// The circuit breaker of publishes (R62), when configured.
    breaker: Mutex<Option<Breaker>>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Whether the breaker lets the cycle fetch (closed or half-open, R62).
    fn breaker_allows_fetch(&self) -> bool {
        let b = self.breaker.lock().expect("breaker poisoned");
        b.as_ref().is_none_or(|b| b.allows(self.clock.now()))
    }

    /// Records a publish result in the breaker; true when it (re)opened.
    fn breaker_record(&self, success: bool) -> bool {
        let mut b = self.breaker.lock().expect("breaker poisoned");
        match b.as_mut() {
            None => false,
            Some(b) if success => {
                b.success();
                false
            }
            Some(b) => b.failure(self.clock.now()),
        }
    }

    fn breaker_is_open(&self) -> bool {
        let b = self.breaker.lock().expect("breaker poisoned");
        b.as_ref().is_some_and(|b| b.is_open())
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// A handle that wakes a waiting loop (for LISTEN/NOTIFY or an in-process writer).
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::backoff::Backoff;
    use crate::clock::ManualClock;
    use crate::event::limits;
    use crate::memory::InMemoryRepository;
    use crate::repository::DeliveryMode;
    use crate::scripted::ScriptedBroker;
    use crate::step::PipelineStep;

    fn builder() -> RelayBuilder {
        let repo = Arc::new(InMemoryRepository::new(Arc::new(
            ManualClock::starting_now(),
        )));
        Relay::builder(repo, Arc::new(ScriptedBroker::new())).worker_id("w1")
    }

    /// The configuration reports every setting as built.
    #[test]
    fn config_reports_the_settings_it_was_built_with() {
        let backoff = Backoff::new(2.0, 50.0).unwrap();
        let relay = builder()
            .delivery(DeliveryMode::Transaction)
            .batch_size(7)
            .lease_ttl(Duration::from_secs(120))
            .max_per_key(3)
            .publish_concurrency(5)
            .publish_timeout(Duration::from_secs(4))
            .poll_interval(Duration::from_secs(2))
            .idle_backoff_max(Duration::from_secs(9))
            .backoff(backoff)
            .build()
            .unwrap();
        let c = relay.config();
        assert_eq!(c.delivery(), DeliveryMode::Transaction);
        assert_eq!(c.worker_id().as_str(), "w1");
        assert_eq!(c.batch_size(), 7);
        assert_eq!(c.lease_ttl(), Duration::from_secs(120));
        assert_eq!(c.max_per_key(), 3);
        assert_eq!(c.publish_concurrency(), 5);
        assert_eq!(c.publish_timeout(), Duration::from_secs(4));
        assert_eq!(c.poll_interval(), Duration::from_secs(2));
        assert_eq!(c.idle_backoff_max(), Duration::from_secs(9));
        assert_eq!(c.backoff(), backoff);
        // A delivery transaction may be idle for 2 × the publish timeout (R84).
        assert_eq!(
            c.delivery_bound().server_timeout,
            Duration::from_secs(2 * 4) + TRANSACTION_OUTCOME_MARGIN
        );
    }

    /// The builder's upper limits are inclusive: 365 days for the durations, and
    /// [`MAX_TRANSACTION_PUBLISH_TIMEOUT`] for the publish timeout in transaction delivery only.
    #[test]
    fn builder_limits_are_inclusive() {
        let year = Duration::from_secs(limits::SETTING_MAX_SECS);
        let over = year + Duration::from_secs(1);
        assert!(builder().lease_ttl(year).build().is_ok());
        assert!(builder().lease_ttl(over).build().is_err());
        assert!(builder().poll_interval(year).build().is_ok());
        assert!(builder().poll_interval(over).build().is_err());
        assert!(builder().idle_backoff_max(year).build().is_ok());
        assert!(builder().idle_backoff_max(over).build().is_err());
        let tx = |t: Duration, mode: DeliveryMode| {
            builder()
                .delivery(mode)
                .publish_timeout(t)
                .lease_ttl(t + Duration::from_secs(1))
                .build()
        };
        let max = MAX_TRANSACTION_PUBLISH_TIMEOUT;
        let above = max + Duration::from_secs(1);
        assert!(tx(max, DeliveryMode::Transaction).is_ok());
        assert!(tx(above, DeliveryMode::Transaction).is_err());
        assert!(tx(above, DeliveryMode::Lease).is_ok());
    }

    struct FetchTimes(Arc<Mutex<Vec<tokio::time::Instant>>>);

    #[async_trait::async_trait]
    impl PipelineStep for FetchTimes {
        async fn on_fetch(&self, _rows: usize) {
            self.0.lock().unwrap().push(tokio::time::Instant::now());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_backoff_doubles_up_to_its_max_and_a_wake_resets_it() {
        let repo = Arc::new(InMemoryRepository::new(Arc::new(
            ManualClock::starting_now(),
        )));
        let times = Arc::new(Mutex::new(Vec::new()));
        let relay = Arc::new(
            Relay::builder(repo, Arc::new(ScriptedBroker::new()))
                .worker_id("w1")
                .poll_interval(Duration::from_secs(1))
                .idle_backoff_max(Duration::from_secs(4))
                .step(Arc::new(FetchTimes(times.clone())))
                .build()
                .unwrap(),
        );
        let t0 = tokio::time::Instant::now();
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (relay, stop) = (relay.clone(), stop.clone());
            async move { relay.run(stop).await }
        });
        tokio::time::sleep(Duration::from_millis(15_500)).await;
        relay.waker().notify_one();
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        stop.cancel();
        task.await.unwrap().unwrap();
        let secs: Vec<f64> = times
            .lock()
            .unwrap()
            .iter()
            .map(|t| (*t - t0).as_secs_f64())
            .collect();
        // Waits 1, 2, 4, 4, 4 → fetches at 0, 1, 3, 7, 11, 15; the wake at 15.5 fetches at once,
        // then the wait is back to 1 s.
        let want = [0.0, 1.0, 3.0, 7.0, 11.0, 15.0, 15.5, 16.5];
        assert_eq!(secs.len(), want.len(), "{secs:?}");
        for (got, want) in secs.iter().zip(want) {
            assert!((got - want).abs() < 0.01, "{secs:?}");
        }
    }
}
