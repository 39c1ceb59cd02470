//! The runner's loop (contract R120, R132, R166, R167): at most `concurrency` deliveries held,
//! one at a time per inbox key in delivery order, pacing after read and persistence errors, and
//! the shutdown that gives back what was not started.
//!
//! # Waiting out the database
//!
//! A delivery that ends in a persistence error (R132) means the database may be away. From then
//! on the loop reads nothing and starts no run: reading on would take deliveries it can only give
//! back, and a broker that bounds what it lets wait (Redis keeps at most `concurrency` rewinds
//! waiting, R136) then leaves the rest to its claim or redelivery timeout, behind later messages
//! of their keys. Instead the loop probes the database, as the relay's loop probes an unreachable
//! broker: a probe opens a transaction and rolls it back (bounded by [`PROBE_TIMEOUT`]), after
//! R120's waits (0.1 s, doubling after each probe that fails, up to 5.0 s). Further persistence
//! errors of the same outage do not lengthen the waits: one outage is one failure, and each
//! failed probe another.
//!
//! The loop does not give back the delivery whose transaction failed (the R132 rewind of
//! [`Runner::handle_delivery`]): it keeps it, renewed (R134, R136), at the head of its key, as it
//! keeps every other delivery it holds; runs in flight finish. Given back, a delivery would come
//! back behind later messages of its key that a client already buffered (a RabbitMQ prefetch, a
//! NATS pull, a Redis read the loop gave up on), and out of their order. Once a probe answers,
//! the loop tries each kept delivery again and starts the next delivery of each key that waited,
//! and reads again; R120's count goes back to 0.1 s once a delivery commits (while a kept
//! delivery still cannot land although the database answers, a missing inbox table, the waits
//! go on growing to 5 s, and each failed try is one warning, R197). At a stop, kept deliveries
//! go back as the other deliveries not started (R167).

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;

use super::{DeliveryOutcome, DeliveryResult, Runner};
use crate::breaker::Breaker;
use crate::inbox::model::InboxKey;
use crate::inbox::repository::{InboxBackend, InboxTransaction};
use crate::inbox::subscription::{AckHandle, InboxDelivery};

/// First wait after a failed read or a persistence error (R120).
pub const LOOP_WAIT_FIRST: Duration = Duration::from_millis(100);
/// Longest such wait (R120).
pub const LOOP_WAIT_MAX: Duration = Duration::from_secs(5);
/// How long one read waits for a delivery before the loop looks around again.
pub const READ_WAIT: Duration = Duration::from_millis(100);
/// How long the loop waits for one probe of the database (a transaction opened and rolled back)
/// while it waits out a persistence outage; a probe that takes longer has failed.
pub const PROBE_TIMEOUT: Duration = LOOP_WAIT_MAX;

/// Why [`Runner::run`] or [`Runner::run_until_stopped`] did not run, or ended with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// `run_until_stopped` was called before `start` (R120); [`Runner::run`] starts the runner
    /// itself.
    #[error("Runner is not started.")]
    NotStarted,
    /// The embedded processor (R121) stopped for good, so recorded failures would never be
    /// tried again: the runner stopped too, as R167 says (R197). Checked by OP-13.
    #[error(
        "the runner stopped because its embedded processor stopped: {0}; restart the consumer once the cause is fixed"
    )]
    ProcessorStopped(#[source] crate::inbox::ProcessorError),
}

/// The wait after `n` consecutive failures (n ≥ 1): 0.1 s doubling up to 5.0 s (R120). Pure.
pub fn loop_wait(n: u32) -> Duration {
    let exp = n.saturating_sub(1).min(16);
    LOOP_WAIT_FIRST
        .saturating_mul(1u32 << exp)
        .min(LOOP_WAIT_MAX)
}

/// Counts a delivery's handler run, if it had one, in the runner's circuit breaker (R62, R120):
/// a completed or skipped run closes it, any other run is a failure.
fn breaker_record(breaker: Option<&mut Breaker>, res: &DeliveryResult) {
    let Some(b) = breaker else {
        return;
    };
    if res.handler_duration.is_none() {
        return;
    }
    if matches!(
        res.outcome,
        DeliveryOutcome::Completed | DeliveryOutcome::Skipped
    ) {
        b.success();
    } else {
        b.failure(tokio::time::Instant::now());
    }
}

/// A delivery's end: its id, key, result, and the delivery itself when the loop keeps it
/// (a persistence error, module docs).
type Done = (u64, Option<InboxKey>, DeliveryResult, Option<InboxDelivery>);

/// A transaction in flight: one delivery, or a batch of them (R185), and their ends.
type Running<'a> = Pin<Box<dyn Future<Output = Vec<Done>> + Send + 'a>>;

/// What the loop holds.
#[derive(Default)]
struct LoopState<'a> {
    inflight: FuturesUnordered<Running<'a>>,
    /// Deliveries in the transactions in flight.
    running: usize,
    /// Keys in a transaction in flight (or, with one message per transaction, whose next
    /// delivery waits to start).
    busy: HashSet<InboxKey>,
    /// Batches (R184): deliveries without a key that wait for a free transaction.
    ready: VecDeque<(u64, InboxDelivery)>,
    /// Every delivery held, handled or waiting for its key, for the renewals (R134, R136).
    held: HashMap<u64, Arc<dyn AckHandle>>,
    waiting: HashMap<InboxKey, VecDeque<(u64, InboxDelivery)>>,
    /// Deliveries without a key kept after a persistence error.
    loose: Vec<(u64, InboxDelivery)>,
    /// Keys whose next delivery waits for the database.
    stalled: Vec<InboxKey>,
    /// During a persistence outage, when the database is probed next.
    outage: Option<tokio::time::Instant>,
    /// R120's consecutive failures.
    failures: u32,
    /// No read before this (R120, after a failed read).
    pause_until: Option<tokio::time::Instant>,
    /// The circuit breaker of handler runs, when configured.
    breaker: Option<Breaker>,
}

impl<B: InboxBackend> Runner<B> {
    fn key_of(&self, d: &InboxDelivery) -> Option<InboxKey> {
        if !self.config.key_order {
            return None;
        }
        self.decode(d).ok().and_then(|e| e.key())
    }

    fn start_one(&self, id: u64, key: Option<InboxKey>, d: InboxDelivery) -> Running<'_> {
        Box::pin(async move {
            let r = self.handle_keeping(&d).await;
            let kept = (r.outcome == DeliveryOutcome::PersistFailed
                && !r.committed
                && r.rewind_delay.is_none())
            .then_some(d);
            vec![(id, key, r, kept)]
        })
    }

    /// Starts one batch transaction (R185) over deliveries of free keys, in delivery order.
    fn start_batch(&self, batch: Vec<(u64, Option<InboxKey>, InboxDelivery)>) -> Running<'_> {
        Box::pin(async move {
            let mut tags = Vec::with_capacity(batch.len());
            let mut ds = Vec::with_capacity(batch.len());
            for (id, key, d) in batch {
                tags.push((id, key));
                ds.push(d);
            }
            let ends = self.handle_batch(&ds).await;
            tags.into_iter()
                .zip(ds.into_iter().zip(ends))
                .map(|((id, key), (d, (r, kept)))| (id, key, r, kept.then_some(d)))
                .collect()
        })
    }

    fn batched(&self) -> bool {
        self.config.messages_per_transaction > 1
    }

    /// Transactions a batched runner may have in flight: ⌊concurrency /
    /// messages_per_transaction⌋ (R183).
    fn max_transactions(&self) -> usize {
        (self.config.concurrency / self.config.messages_per_transaction).max(1)
    }

    /// Batches (R184): starts transactions while one is free, each over the deliveries held
    /// whose keys are in no transaction, in delivery order, at most messages_per_transaction;
    /// never waits to fill one. A key's deliveries stay in delivery order: one batch may hold
    /// several of a key, and a key in a transaction in flight waits for it.
    fn pump<'a>(&'a self, st: &mut LoopState<'a>) {
        if st.outage.is_some() {
            return;
        }
        let max_tx = self.max_transactions();
        if st.inflight.len() >= max_tx {
            return;
        }
        let mut cands: Vec<(u64, Option<InboxKey>, InboxDelivery)> = Vec::new();
        let free_keys: Vec<InboxKey> = st
            .waiting
            .keys()
            .filter(|k| !st.busy.contains(*k))
            .cloned()
            .collect();
        for k in free_keys {
            if let Some(q) = st.waiting.remove(&k) {
                cands.extend(q.into_iter().map(|(id, d)| (id, Some(k.clone()), d)));
            }
        }
        cands.extend(st.ready.drain(..).map(|(id, d)| (id, None, d)));
        cands.sort_by_key(|(id, _, _)| *id);
        let mpt = self.config.messages_per_transaction;
        let mut batch: Vec<(u64, Option<InboxKey>, InboxDelivery)> = Vec::new();
        for (id, key, d) in cands {
            let room = st.inflight.len() < max_tx;
            let key_free = key.as_ref().is_none_or(|k| !st.busy.contains(k));
            if room && key_free {
                batch.push((id, key, d));
                if batch.len() == mpt {
                    self.launch(st, std::mem::take(&mut batch));
                }
                continue;
            }
            match key {
                Some(k) => st.waiting.entry(k).or_default().push_back((id, d)),
                None => st.ready.push_back((id, d)),
            }
        }
        if !batch.is_empty() {
            self.launch(st, batch);
        }
    }

    fn launch<'a>(
        &'a self,
        st: &mut LoopState<'a>,
        batch: Vec<(u64, Option<InboxKey>, InboxDelivery)>,
    ) {
        for (_, k, _) in &batch {
            if let Some(k) = k {
                st.busy.insert(k.clone());
            }
        }
        st.running += batch.len();
        st.inflight.push(self.start_batch(batch));
    }

    /// A batch's transaction ended (R185, R188): R120's count, the breaker, the outage; kept
    /// deliveries go back to the heads of their keys; the keys are free again.
    async fn finished_batch<'a>(&'a self, st: &mut LoopState<'a>, dones: Vec<Done>) {
        st.running = st.running.saturating_sub(dones.len());
        let mut keep = Vec::new();
        for (id, key, res, kept) in dones {
            if res.outcome == DeliveryOutcome::PersistFailed {
                if st.outage.is_none() {
                    st.failures = st.failures.saturating_add(1);
                    st.outage = Some(tokio::time::Instant::now() + loop_wait(st.failures));
                    tracing::warn!(
                        error = res.error.as_deref().unwrap_or(""),
                        "a persistence error: the runner reads nothing until the database answers"
                    );
                }
            } else if res.committed && st.outage.is_none() {
                st.failures = 0;
                st.pause_until = None;
            }
            breaker_record(st.breaker.as_mut(), &res);
            if let Some(k) = &key {
                st.busy.remove(k);
            }
            match kept {
                Some(d) => keep.push((id, key, d)),
                None => {
                    st.held.remove(&id);
                }
            }
        }
        // Kept, still held and renewed: first of their keys again, in delivery order, tried
        // once the database answers.
        for (id, key, d) in keep.into_iter().rev() {
            match key {
                Some(k) => st.waiting.entry(k).or_default().push_front((id, d)),
                None => st.ready.push_front((id, d)),
            }
        }
        self.pump(st);
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
    ///
    /// When the embedded processor stops for good (its fetch failed in a way retrying cannot
    /// fix, [`ProcessorError::Repository`](crate::inbox::ProcessorError::Repository)), the
    /// runner logs it at error, stops as [`stop`](Runner::stop) does, and ends with
    /// [`RunnerError::ProcessorStopped`]: a consumer never goes on without the processor that
    /// retries its recorded failures (R197). Checked by OP-13.
    pub async fn run_until_stopped(&self) -> Result<(), RunnerError> {
        if !self.started.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(RunnerError::NotStarted);
        }
        let processor = async {
            match &self.embedded {
                Some(p) => match p.run(self.stop.child_token()).await {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        tracing::error!(
                            group = %self.config.group.as_str(),
                            error = %crate::redact::secrets(&e.to_string()),
                            "the embedded inbox processor stopped; the runner stops too and ends with an error"
                        );
                        self.stop.cancel();
                        Err(RunnerError::ProcessorStopped(e))
                    }
                },
                None => Ok(()),
            }
        };
        let ((), processor) = futures::join!(self.delivery_loop(), processor);
        processor
    }

    async fn delivery_loop(&self) {
        let renew_every = self.subscription.capabilities().renew_every;
        let mut renew =
            renew_every.map(|d| tokio::time::interval_at(tokio::time::Instant::now() + d, d));
        let mut st = LoopState {
            breaker: self.config.breaker.map(Breaker::new),
            ..LoopState::default()
        };
        let mut next_id = 0u64;
        loop {
            if self.stop.is_cancelled() {
                break;
            }
            if let Some(probe_at) = st.outage {
                // No read, no run: runs in flight finish; the database is probed.
                tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => break,
                    Some(done) = st.inflight.next(), if !st.inflight.is_empty() => {
                        self.finished(&mut st, done).await;
                    }
                    _ = tick(&mut renew) => renew_all(&st.held).await,
                    up = async {
                        tokio::time::sleep_until(probe_at).await;
                        self.database_answers().await
                    } => {
                        if up {
                            tracing::info!("the database answers again; the runner goes on");
                            st.outage = None;
                            // R120's count stays until a delivery commits: a delivery that
                            // still cannot land although the database answers (a missing
                            // table) is tried at growing waits, up to 5 s, not every 0.1 s.
                            st.pause_until = None;
                            for k in std::mem::take(&mut st.stalled) {
                                self.start_next(k, &mut st);
                            }
                            for (id, d) in std::mem::take(&mut st.loose) {
                                st.running += 1;
                                st.inflight.push(self.start_one(id, None, d));
                            }
                            if self.batched() {
                                self.pump(&mut st);
                            }
                        } else {
                            st.failures = st.failures.saturating_add(1);
                            let wait = loop_wait(st.failures);
                            tracing::debug!(retry_in = ?wait, "the database is still away");
                            st.outage = Some(tokio::time::Instant::now() + wait);
                        }
                    }
                }
                continue;
            }
            if let Some(t) = st.breaker.as_ref().and_then(Breaker::reopens_at)
                && tokio::time::Instant::now() < t
            {
                // Open: no read, no run; runs in flight finish. From `t` on it is half-open:
                // the next run goes ahead.
                tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => break,
                    Some(done) = st.inflight.next(), if !st.inflight.is_empty() => {
                        self.finished(&mut st, done).await;
                    }
                    _ = tick(&mut renew) => renew_all(&st.held).await,
                    _ = tokio::time::sleep_until(t) => {}
                }
                continue;
            }
            let taken = st.running
                + st.loose.len()
                + st.ready.len()
                + st.waiting.values().map(VecDeque::len).sum::<usize>();
            let mut free = self.config.concurrency.saturating_sub(taken);
            if self.batched() {
                // R184: read when a transaction is free, at most one batch.
                free = if st.inflight.len() < self.max_transactions() {
                    free.min(self.config.messages_per_transaction)
                } else {
                    0
                };
            }
            let pause = st.pause_until;
            let read = async move {
                if let Some(t) = pause {
                    tokio::time::sleep_until(t).await;
                }
                self.subscription.next(free, READ_WAIT).await
            };
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => break,
                _ = tick(&mut renew) => renew_all(&st.held).await,
                Some(done) = st.inflight.next(), if !st.inflight.is_empty() => {
                    self.finished(&mut st, done).await;
                }
                got = read, if free > 0 => {
                    match got {
                        Err(e) => {
                            st.failures = st.failures.saturating_add(1);
                            tracing::warn!(error = %e, "reading the subscription failed");
                            st.pause_until = Some(tokio::time::Instant::now() + loop_wait(st.failures));
                        }
                        Ok(ds) if self.batched() => {
                            st.pause_until = None;
                            for d in ds {
                                let id = next_id;
                                next_id += 1;
                                st.held.insert(id, d.ack.clone());
                                match self.key_of(&d) {
                                    Some(k) => st.waiting.entry(k).or_default().push_back((id, d)),
                                    None => st.ready.push_back((id, d)),
                                }
                            }
                            self.pump(&mut st);
                        }
                        Ok(ds) => {
                            st.pause_until = None;
                            for d in ds {
                                let id = next_id;
                                next_id += 1;
                                st.held.insert(id, d.ack.clone());
                                let key = self.key_of(&d);
                                match key {
                                    Some(k) if st.busy.contains(&k) => {
                                        st.waiting.entry(k).or_default().push_back((id, d));
                                    }
                                    Some(k) => {
                                        st.busy.insert(k.clone());
                                        st.running += 1;
                                        st.inflight.push(self.start_one(id, Some(k), d));
                                    }
                                    None => {
                                        st.running += 1;
                                        st.inflight.push(self.start_one(id, None, d));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // Deliveries kept without a key go back as those waiting for their key (R167).
        let ready: Vec<(u64, InboxDelivery)> = st.ready.drain(..).collect();
        st.loose.extend(ready);
        for (_, d) in std::mem::take(&mut st.loose) {
            if d.is_last() {
                let r = self.land_only(&d).await;
                self.after(&r);
            } else if let Err(e) = d.ack.rewind(Duration::ZERO).await {
                tracing::warn!(error = %e, "giving a delivery back at shutdown failed");
            }
        }
        self.shutdown(st.waiting, st.inflight).await;
    }

    /// A transaction ended: its deliveries' ends.
    async fn finished<'a>(&'a self, st: &mut LoopState<'a>, dones: Vec<Done>) {
        if self.batched() {
            self.finished_batch(st, dones).await;
            return;
        }
        for done in dones {
            st.running = st.running.saturating_sub(1);
            self.finished_one(st, done).await;
        }
    }

    /// A delivery ended, or came back kept after a persistence error: R120's count, the
    /// breaker, the outage, and the next delivery of its key.
    async fn finished_one<'a>(&'a self, st: &mut LoopState<'a>, done: Done) {
        let (id, key, res, kept) = done;
        if res.outcome == DeliveryOutcome::PersistFailed {
            if st.outage.is_none() {
                st.failures = st.failures.saturating_add(1);
                st.outage = Some(tokio::time::Instant::now() + loop_wait(st.failures));
                tracing::warn!(
                    error = res.error.as_deref().unwrap_or(""),
                    "a persistence error: the runner reads nothing until the database answers"
                );
            }
        } else if res.committed && st.outage.is_none() {
            st.failures = 0;
            st.pause_until = None;
        }
        breaker_record(st.breaker.as_mut(), &res);
        if let Some(d) = kept {
            // Kept, still held and renewed: first of its key again, tried once the database
            // answers.
            match key {
                Some(k) => {
                    st.waiting.entry(k.clone()).or_default().push_front((id, d));
                    st.stalled.push(k);
                }
                None => st.loose.push((id, d)),
            }
            return;
        }
        st.held.remove(&id);
        if let Some(k) = self.on_done(key, &res, st).await {
            if st.outage.is_some() {
                st.stalled.push(k);
            } else {
                self.start_next(k, st);
            }
        }
    }
    /// The probe of a persistence outage: a transaction opened and rolled back within
    /// [`PROBE_TIMEOUT`].
    async fn database_answers(&self) -> bool {
        match tokio::time::timeout(PROBE_TIMEOUT, self.backend.begin()).await {
            Ok(Ok(tx)) => {
                tx.rollback().await;
                true
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "the database probe failed");
                false
            }
            Err(_) => {
                tracing::debug!(timeout = ?PROBE_TIMEOUT, "the database probe did not answer in time");
                false
            }
        }
    }

    /// After a delivery ended: a persistence error that rewound it takes the deliveries of its
    /// key that wait back with it (R132, [`Runner::handle_delivery`]). Returns the key when a
    /// delivery of it waits to start next; the key stays busy until
    /// [`start_next`](Self::start_next) starts it.
    async fn on_done(
        &self,
        key: Option<InboxKey>,
        res: &DeliveryResult,
        st: &mut LoopState<'_>,
    ) -> Option<InboxKey> {
        if res.outcome == DeliveryOutcome::PersistFailed
            && let (Some(k), Some(delay)) = (&key, res.rewind_delay)
            && let Some(q) = st.waiting.remove(k)
        {
            for (id, d) in q {
                st.held.remove(&id);
                if let Err(e) = d.ack.rewind(delay).await {
                    tracing::warn!(error = %e, "rewinding a waiting delivery failed");
                }
            }
        }
        let k = key?;
        if st.waiting.get(&k).is_some_and(|q| !q.is_empty()) {
            Some(k)
        } else {
            st.waiting.remove(&k);
            st.busy.remove(&k);
            None
        }
    }

    /// Starts the next delivery of `k`, which [`on_done`](Self::on_done) returned or a kept
    /// delivery heads.
    fn start_next<'a>(&'a self, k: InboxKey, st: &mut LoopState<'a>) {
        match st.waiting.get_mut(&k).and_then(VecDeque::pop_front) {
            Some((id, d)) => {
                st.running += 1;
                st.inflight.push(self.start_one(id, Some(k), d));
            }
            None => {
                st.waiting.remove(&k);
                st.busy.remove(&k);
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

    use std::sync::atomic::{AtomicUsize, Ordering};

    use async_trait::async_trait;
    use chrono::{DateTime, Utc};

    use crate::clock::Clock;
    use crate::event::Status;
    use crate::inbox::decode::BrokerMessage;
    use crate::inbox::handler::{Handler, HandlerError, HandlerOutcome};
    use crate::inbox::memory::{InMemoryInbox, MemInboxTx};
    use crate::inbox::model::InboxEvent;
    use crate::inbox::scripted::{AckOp, MessageFactory, ScriptedSubscription};
    use crate::inbox::subscription::{Subscription, SubscriptionCapabilities, SubscriptionError};

    /// Wall time that moves with tokio's paused clock, so that the scripted subscription's
    /// rewinds come due as paused time passes.
    #[derive(Debug)]
    struct PausedWall {
        start: tokio::time::Instant,
        wall: DateTime<Utc>,
    }

    impl Clock for PausedWall {
        fn now(&self) -> DateTime<Utc> {
            self.wall + chrono::Duration::from_std(self.start.elapsed()).expect("elapsed")
        }
    }

    /// The scripted subscription, counting the runner's reads.
    struct Counting {
        inner: ScriptedSubscription,
        reads: AtomicUsize,
    }

    impl Counting {
        fn reads(&self) -> usize {
            self.reads.load(Ordering::SeqCst)
        }
    }

    #[async_trait]
    impl Subscription for Counting {
        fn capabilities(&self) -> SubscriptionCapabilities {
            self.inner.capabilities()
        }
        async fn next(
            &self,
            max: usize,
            wait: Duration,
        ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            self.inner.next(max, wait).await
        }
        async fn close(&self) {
            self.inner.close().await;
        }
    }

    /// Completes every row; `slow` takes 500 ms.
    struct Done;

    #[async_trait]
    impl Handler<MemInboxTx> for Done {
        async fn handle(
            &self,
            row: &InboxEvent,
            _tx: &mut MemInboxTx,
        ) -> Result<HandlerOutcome, HandlerError> {
            if row.message_id == "slow" {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Ok(HandlerOutcome::completed())
        }
    }

    struct Bed {
        inbox: InMemoryInbox,
        scripted: ScriptedSubscription,
        sub: Arc<Counting>,
        runner: Runner<InMemoryInbox>,
        factory: MessageFactory,
    }

    impl Bed {
        fn new() -> Self {
            let clock = Arc::new(PausedWall {
                start: tokio::time::Instant::now(),
                wall: Utc::now(),
            });
            let inbox = InMemoryInbox::new(clock.clone());
            let scripted = ScriptedSubscription::new(clock);
            let sub = Arc::new(Counting {
                inner: scripted.clone(),
                reads: AtomicUsize::new(0),
            });
            let runner = Runner::builder(inbox.clone(), sub.clone(), "g")
                .worker_id("w1")
                .handler(Arc::new(Done))
                .process_stored(false)
                .messages_per_transaction(1)
                .concurrency(4)
                .build()
                .expect("runner");
            runner.start();
            Self {
                inbox,
                scripted,
                sub,
                runner,
                factory: MessageFactory::new(),
            }
        }

        fn message(&self, id: &str, key: &str) -> BrokerMessage {
            self.factory.nats(
                &[
                    ("event_id", id),
                    ("topic", "src"),
                    ("event_type", "e"),
                    ("partition_key", key),
                ],
                r#"{"n": 1}"#,
            )
        }

        fn push(&self, id: &str, key: &str) -> usize {
            self.scripted.push(self.message(id, key))
        }

        fn status(&self, id: &str) -> Option<Status> {
            self.inbox
                .rows()
                .into_iter()
                .find(|r| r.message_id == id)
                .map(|r| r.status)
        }
    }

    /// A persistence outage stops reading: no read while the database is away, and reading
    /// resumes at the first probe that answers (0.1, 0.3, 0.7, 1.5 and 3.1 s after the first
    /// persistence error: R120's waits); the deliveries kept (never given back) and the message
    /// that came meanwhile are then handled.
    #[tokio::test(start_paused = true)]
    async fn a_persistence_outage_stops_reading_until_the_database_answers() {
        let b = Bed::new();
        let m1 = b.push("m1", "k1");
        let m2 = b.push("m2", "k2");
        let m3 = b.push("m3", "k1");
        b.inbox.set_down(true);
        let control = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            // The first read took m1 to m3; m1 and m2 failed, m3 waits behind m1: all three are
            // kept, none given back.
            let reads = b.sub.reads();
            for m in [m1, m2, m3] {
                assert!(b.scripted.acks(m).is_empty(), "{:?}", b.scripted.acks(m));
            }
            let m4 = b.push("m4", "k3");
            tokio::time::sleep(Duration::from_millis(2450)).await;
            // t = 2.5 s: m4 waits, yet nothing was read.
            assert_eq!(b.sub.reads(), reads, "a read while the database was away");
            assert_eq!(b.scripted.deliveries(m4), 0);
            b.inbox.set_down(false);
            tokio::time::sleep(Duration::from_millis(550)).await;
            // t = 3.05 s: the probe at 1.5 s failed; the next is at 3.1 s.
            assert_eq!(b.sub.reads(), reads, "a read before the probe answered");
            tokio::time::sleep(Duration::from_millis(100)).await;
            // t = 3.15 s: the probe answered; the kept deliveries ran, reading resumed, all
            // four are handled, each on its first delivery.
            assert!(b.sub.reads() > reads, "no read after the probe answered");
            for id in ["m1", "m2", "m3", "m4"] {
                assert_eq!(b.status(id), Some(Status::Completed), "{id}");
            }
            for m in [m1, m2, m3, m4] {
                assert_eq!(b.scripted.acks(m), vec![AckOp::Commit]);
                assert_eq!(b.scripted.deliveries(m), 1);
            }
            b.runner.stop();
        };
        let (done, ()) = tokio::join!(b.runner.run_until_stopped(), control);
        done.expect("run");
    }

    /// A delivery held when the outage began (waiting for its key behind a run that then
    /// commits) is neither started during the outage nor given back, and neither is the one
    /// whose transaction failed: both run as soon as the database answers a probe.
    #[tokio::test(start_paused = true)]
    async fn a_held_delivery_starts_once_the_database_answers() {
        let b = Bed::new();
        let slow = b.push("slow", "k1");
        let m2 = b.push("m2", "k1");
        let control = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            // t = 0.2 s: `slow` runs (500 ms), m2 waits for k1; the database goes away and m3's
            // transaction fails: the outage begins (probes at 0.3, 0.5, 0.9, 1.7 s).
            b.inbox.set_down(true);
            let m3 = b.push("m3", "k2");
            tokio::time::sleep(Duration::from_millis(400)).await;
            // t = 0.6 s: `slow` committed; m2 is held, not started.
            assert_eq!(b.scripted.acks(slow), vec![AckOp::Commit]);
            assert_eq!(b.status("slow"), Some(Status::Completed));
            assert!(b.scripted.acks(m3).is_empty(), "m3 was given back");
            let reads = b.sub.reads();
            tokio::time::sleep(Duration::from_millis(400)).await;
            b.inbox.set_down(false);
            tokio::time::sleep(Duration::from_millis(650)).await;
            // t = 1.65 s: still waiting for the probe at 1.7 s.
            assert_eq!(b.status("m2"), None);
            assert!(b.scripted.acks(m2).is_empty(), "m2 was given back");
            assert_eq!(b.sub.reads(), reads);
            tokio::time::sleep(Duration::from_millis(100)).await;
            // t = 1.75 s: m2 and the kept m3 ran, each on its first delivery.
            assert_eq!(b.status("m2"), Some(Status::Completed));
            assert_eq!(b.scripted.deliveries(m2), 1);
            assert_eq!(b.scripted.acks(m2), vec![AckOp::Commit]);
            assert_eq!(b.status("m3"), Some(Status::Completed));
            assert_eq!(b.scripted.acks(m3), vec![AckOp::Commit]);
            assert_eq!(b.scripted.deliveries(m3), 1);
            assert_eq!(b.scripted.acks(slow), vec![AckOp::Commit]);
            b.runner.stop();
        };
        let (done, ()) = tokio::join!(b.runner.run_until_stopped(), control);
        done.expect("run");
    }

    #[test]
    fn waits_double_to_the_cap() {
        assert_eq!(loop_wait(1), Duration::from_millis(100));
        assert_eq!(loop_wait(2), Duration::from_millis(200));
        assert_eq!(loop_wait(3), Duration::from_millis(400));
        assert_eq!(loop_wait(7), Duration::from_secs(5));
        assert_eq!(loop_wait(u32::MAX), Duration::from_secs(5));
    }
}
