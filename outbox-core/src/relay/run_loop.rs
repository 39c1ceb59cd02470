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
    /// (far fewer cycles and row writes while the broker is down). The broker's reconnection
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
mod tests;
