//! The runner's loop (contract R120, R132, R166, R167): at most `concurrency` deliveries held,
//! one at a time per inbox key in delivery order, pacing after read and persistence errors, and
//! the shutdown that gives back what was not started.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;

use super::{DeliveryOutcome, DeliveryResult, Runner};
use crate::inbox::model::InboxKey;
use crate::inbox::repository::InboxBackend;
use crate::inbox::subscription::{AckHandle, InboxDelivery};

/// First wait after a failed read or a persistence error (R120).
pub const LOOP_WAIT_FIRST: Duration = Duration::from_millis(100);
/// Longest such wait (R120).
pub const LOOP_WAIT_MAX: Duration = Duration::from_secs(5);
/// How long one read waits for a delivery before the loop looks around again.
pub const READ_WAIT: Duration = Duration::from_millis(100);

/// Why [`Runner::run`] or [`Runner::run_until_stopped`] did not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// `run_until_stopped` was called before `start` (R120); [`Runner::run`] starts the runner
    /// itself.
    #[error("Runner is not started.")]
    NotStarted,
}

/// The wait after `n` consecutive failures (n ≥ 1): 0.1 s doubling up to 5.0 s (R120). Pure.
pub fn loop_wait(n: u32) -> Duration {
    let exp = n.saturating_sub(1).min(16);
    LOOP_WAIT_FIRST
        .saturating_mul(1u32 << exp)
        .min(LOOP_WAIT_MAX)
}

type Running<'a> =
    Pin<Box<dyn Future<Output = (u64, Option<InboxKey>, DeliveryResult)> + Send + 'a>>;

impl<B: InboxBackend> Runner<B> {
    fn key_of(&self, d: &InboxDelivery) -> Option<InboxKey> {
        if !self.config.key_order {
            return None;
        }
        self.decode(d).ok().and_then(|e| e.key())
    }

    fn start_one(&self, id: u64, key: Option<InboxKey>, d: InboxDelivery) -> Running<'_> {
        Box::pin(async move {
            let r = self.handle_delivery(d).await;
            (id, key, r)
        })
    }

    /// Runs the runner until `shutdown` is cancelled, as [`Relay::run`](crate::Relay::run) and
    /// [`Processor::run`](crate::inbox::Processor::run) run theirs: it starts the runner, reads
    /// and handles deliveries with the embedded processor beside it (R120, R121, R166), and
    /// after the cancel stops as R167 says (reading ends, deliveries not started go back, the
    /// runs in flight finish, the subscription is closed) before it returns. This is the loop
    /// to use: nothing else needs calling. [`stop`](Runner::stop) ends it as well.
    ///
    /// Checked by the runner tests of `runner::consumer_tests` (`run_token_*`).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), RunnerError> {
        self.start();
        let looping = self.run_until_stopped();
        tokio::pin!(looping);
        tokio::select! {
            done = &mut looping => done,
            () = shutdown.cancelled() => {
                self.stop();
                looping.await
            }
        }
    }

    /// The low-level form of [`run`](Runner::run), kept for callers that drive the runner's
    /// states themselves: runs the loop until [`stop`](Runner::stop) (R120, R166, R167), with
    /// the embedded processor beside it (R121). Fails with `Runner is not started.` before
    /// [`start`](Runner::start) (R120).
    pub async fn run_until_stopped(&self) -> Result<(), RunnerError> {
        if !self.started.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(RunnerError::NotStarted);
        }
        let processor = async {
            if let Some(p) = &self.embedded
                && let Err(e) = p.run(self.stop.child_token()).await
            {
                tracing::error!(error = %e, "the embedded inbox processor stopped");
            }
        };
        futures::join!(self.delivery_loop(), processor);
        Ok(())
    }

    async fn delivery_loop(&self) {
        let mut inflight: FuturesUnordered<Running<'_>> = FuturesUnordered::new();
        let mut busy: HashSet<InboxKey> = HashSet::new();
        // Every delivery held, handled or waiting for its key, for the renewals (R134, R136).
        let mut held: HashMap<u64, Arc<dyn AckHandle>> = HashMap::new();
        let mut next_id = 0u64;
        let renew_every = self.subscription.capabilities().renew_every;
        let mut renew =
            renew_every.map(|d| tokio::time::interval_at(tokio::time::Instant::now() + d, d));
        let mut waiting: HashMap<InboxKey, VecDeque<(u64, InboxDelivery)>> = HashMap::new();
        let mut failures = 0u32;
        let mut pause_until: Option<tokio::time::Instant> = None;
        // The breaker (R62, R120): consecutive failed handler runs, and when it opened.
        let mut run_failures = 0u32;
        let mut open_until: Option<tokio::time::Instant> = None;
        loop {
            if self.stop.is_cancelled() {
                break;
            }
            if let Some(t) = open_until {
                if tokio::time::Instant::now() >= t {
                    // Half-open: the next run goes ahead.
                    open_until = None;
                } else {
                    // Open: no read, no run; runs in flight finish.
                    tokio::select! {
                        biased;
                        _ = self.stop.cancelled() => break,
                        Some((id, key, res)) = inflight.next(), if !inflight.is_empty() => {
                            held.remove(&id);
                            self.on_done(key, &res, &mut waiting, &mut busy, &mut held, &mut inflight).await;
                        }
                        _ = tick(&mut renew) => renew_all(&held).await,
                        _ = tokio::time::sleep_until(t) => {}
                    }
                    continue;
                }
            }
            let taken = inflight.len() + waiting.values().map(VecDeque::len).sum::<usize>();
            let free = self.config.concurrency.saturating_sub(taken);
            let pause = pause_until;
            let read = async move {
                if let Some(t) = pause {
                    tokio::time::sleep_until(t).await;
                }
                self.subscription.next(free, READ_WAIT).await
            };
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => break,
                _ = tick(&mut renew) => renew_all(&held).await,
                Some((id, key, res)) = inflight.next(), if !inflight.is_empty() => {
                    held.remove(&id);
                    if res.outcome == DeliveryOutcome::PersistFailed {
                        failures += 1;
                        pause_until = Some(tokio::time::Instant::now() + loop_wait(failures));
                    } else if res.committed {
                        failures = 0;
                        pause_until = None;
                    }
                    if let Some((threshold, recovery)) = self.config.breaker
                        && res.handler_duration.is_some()
                    {
                        let failed = !matches!(res.outcome, DeliveryOutcome::Completed | DeliveryOutcome::Skipped);
                        if failed {
                            run_failures = run_failures.saturating_add(1);
                            if run_failures >= threshold {
                                open_until = Some(tokio::time::Instant::now() + recovery);
                            }
                        } else {
                            run_failures = 0;
                        }
                    }
                    self.on_done(key, &res, &mut waiting, &mut busy, &mut held, &mut inflight).await;
                }
                got = read, if free > 0 => {
                    match got {
                        Err(e) => {
                            failures += 1;
                            tracing::warn!(error = %e, "reading the subscription failed");
                            pause_until = Some(tokio::time::Instant::now() + loop_wait(failures));
                        }
                        Ok(ds) => {
                            pause_until = None;
                            for d in ds {
                                let id = next_id;
                                next_id += 1;
                                held.insert(id, d.ack.clone());
                                let key = self.key_of(&d);
                                match key {
                                    Some(k) if busy.contains(&k) => {
                                        waiting.entry(k).or_default().push_back((id, d));
                                    }
                                    Some(k) => {
                                        busy.insert(k.clone());
                                        inflight.push(self.start_one(id, Some(k), d));
                                    }
                                    None => inflight.push(self.start_one(id, None, d)),
                                }
                            }
                        }
                    }
                }
            }
        }
        self.shutdown(waiting, inflight).await;
    }

    /// After a delivery ended: a persistence error takes the deliveries of its key that wait
    /// back with it (R132); otherwise the next delivery of its key starts.
    async fn on_done<'a>(
        &'a self,
        key: Option<InboxKey>,
        res: &DeliveryResult,
        waiting: &mut HashMap<InboxKey, VecDeque<(u64, InboxDelivery)>>,
        busy: &mut HashSet<InboxKey>,
        held: &mut HashMap<u64, Arc<dyn AckHandle>>,
        inflight: &mut FuturesUnordered<Running<'a>>,
    ) {
        if res.outcome == DeliveryOutcome::PersistFailed
            && let (Some(k), Some(delay)) = (&key, res.rewind_delay)
            && let Some(q) = waiting.remove(k)
        {
            for (id, d) in q {
                held.remove(&id);
                if let Err(e) = d.ack.rewind(delay).await {
                    tracing::warn!(error = %e, "rewinding a waiting delivery failed");
                }
            }
        }
        if let Some(k) = key {
            match waiting.get_mut(&k).and_then(VecDeque::pop_front) {
                Some((id, d)) => inflight.push(self.start_one(id, Some(k), d)),
                None => {
                    waiting.remove(&k);
                    busy.remove(&k);
                }
            }
        }
    }

    async fn shutdown<'a>(
        &'a self,
        mut waiting: HashMap<InboxKey, VecDeque<(u64, InboxDelivery)>>,
        mut inflight: FuturesUnordered<Running<'a>>,
    ) {
        // R167: reading ends; deliveries not started go back at once; a last delivery is landed
        // instead (R182), once the earlier deliveries of its key have ended.
        self.subscription.stop_reading().await;
        let mut lasts = Vec::new();
        for (_, q) in waiting.drain() {
            for (_, d) in q {
                if d.is_last() {
                    lasts.push(d);
                } else if let Err(e) = d.ack.rewind(Duration::ZERO).await {
                    tracing::warn!(error = %e, "giving a delivery back at shutdown failed");
                }
            }
        }
        while inflight.next().await.is_some() {}
        for d in lasts {
            let r = self.land_only(&d).await;
            self.after(&r);
        }
        self.subscription.close().await;
    }
}

/// The next renewal tick, or never.
async fn tick(renew: &mut Option<tokio::time::Interval>) {
    match renew {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Renews every held delivery (R134, R136).
async fn renew_all(held: &HashMap<u64, Arc<dyn AckHandle>>) {
    for ack in held.values() {
        if let Err(e) = ack.renew().await {
            tracing::warn!(error = %e, "renewing a held delivery failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_to_the_cap() {
        assert_eq!(loop_wait(1), Duration::from_millis(100));
        assert_eq!(loop_wait(2), Duration::from_millis(200));
        assert_eq!(loop_wait(3), Duration::from_millis(400));
        assert_eq!(loop_wait(7), Duration::from_secs(5));
        assert_eq!(loop_wait(u32::MAX), Duration::from_secs(5));
    }
}
