//! The inbox's Kafka subscription (contract R175, R176, R179, R140; brokers.md Part 3).
//!
//! [`KafkaSubscription`] reads the topics prefix + topic as a member of one Kafka consumer group,
//! through krafka's consumer-group API: automatic commits off, a new group starting at the
//! earliest offset (`auto_offset_reset`, R175), isolation level `read_committed`, the worker id
//! as client id. A background task keeps polling (so the group session and rebalances are
//! served while deliveries run, R176) into a bounded buffer; the runner's reads take from it.
//!
//! The operations of a delivery (R176):
//!
//! | operation | Kafka |
//! |---|---|
//! | commit | the record ends; whenever the lowest offset of its partition not ended moves, an OffsetCommit of that offset, confirmed |
//! | rewind(d) | the partition is paused; records at or after the rewound one that were read and not handed out are set aside; after d it is sought back to the rewound record and resumed |
//! | term(reason) | the record ends, as by commit |
//! | renew | nothing (no lease on a record) |
//! | dead-letter copy | a record to the topic + `.dead-letter` with the key, value and headers as received plus R140's, acks = all |
//!
//! A commit never passes a record that has not ended, whatever the concurrency: each partition
//! keeps the offsets read and not ended, and commits the lowest of them. The delivery number n is
//! 1 + the deliveries of that record this subscription has handed out since it got the
//! partition (a new owner counts from 1); there is no last delivery. At a rebalance the
//! partitions going away stop handing out records, the records not handed out are set aside,
//! the runs in flight are waited for (at most `revoke_timeout`), the progress is committed, and
//! only then does the partition go; a delivery of a partition this runner no longer holds cannot
//! commit (commit_failed, R131), and the new owner reads it again. Checked by J-16 to J-22 and
//! J-33 (Kafka part) in this crate's `tests/inbox.rs`, and by the shared broker trials.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use krafka::consumer::{
    AutoOffsetReset, Consumer, ConsumerRebalanceListener, ConsumerRecord, IsolationLevel,
    OffsetAndMetadata, TopicPartition,
};
use krafka::producer::{Acks, Producer};
use krafka::{Kafka, Record};
use tokio::time::Instant;
use txoutbox_core::inbox::decode::BrokerMessage;
use txoutbox_core::inbox::subscription::{
    AckHandle, InboxDelivery, Subscription, SubscriptionCapabilities, SubscriptionError,
};

use crate::{Idempotence, KafkaBrokerConfig, KafkaBrokerError};

/// Default suffix of the dead-letter topic (R140).
pub const DEFAULT_DEAD_LETTER_SUFFIX: &str = ".dead-letter";
/// Default group session timeout.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);
/// Default bound on the wait for runs in flight when a partition is taken away.
pub const DEFAULT_REVOKE_TIMEOUT: Duration = Duration::from_secs(60);
/// The bound on the metadata request that checks the dead-letter topic exists.
const DEAD_LETTER_METADATA_WAIT: Duration = Duration::from_secs(2);
/// Default number of records read ahead of the runner.
pub const DEFAULT_MAX_BUFFERED: usize = 100;

/// Where a group without a committed offset for a partition starts (R175).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffsetReset {
    /// At the partition's earliest offset (default): records written before the group existed
    /// are landed.
    #[default]
    Earliest,
    /// At the end of the partition.
    Latest,
}

/// Settings of a [`KafkaSubscription`].
#[derive(Debug, Clone)]
pub struct KafkaSubscriptionConfig {
    connection: KafkaBrokerConfig,
    group: String,
    group_id: Option<String>,
    topics: Vec<String>,
    client_id: Option<String>,
    offset_reset: OffsetReset,
    read_committed: bool,
    session_timeout: Duration,
    revoke_timeout: Duration,
    dead_letter_suffix: String,
    max_buffered: usize,
    at_most_once: bool,
}

impl KafkaSubscriptionConfig {
    /// Reads `topics` (each under the connection's topic prefix, R86) for consumer group
    /// `group`, connecting as `connection` says (brokers, TLS, SASL, topic prefix; its
    /// idempotence is that of the dead-letter producer).
    pub fn new<S: Into<String>>(
        connection: KafkaBrokerConfig,
        group: impl Into<String>,
        topics: impl IntoIterator<Item = S>,
    ) -> Self {
        Self {
            connection,
            group: group.into(),
            group_id: None,
            topics: topics.into_iter().map(Into::into).collect(),
            client_id: None,
            offset_reset: OffsetReset::Earliest,
            read_committed: true,
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            revoke_timeout: DEFAULT_REVOKE_TIMEOUT,
            dead_letter_suffix: DEFAULT_DEAD_LETTER_SUFFIX.into(),
            max_buffered: DEFAULT_MAX_BUFFERED,
            at_most_once: false,
        }
    }

    /// The runner runs at_most_once (R129): a commit then returns only once an OffsetCommit that
    /// passes its record is confirmed (R176), not as soon as the record ended.
    pub fn at_most_once(mut self, on: bool) -> Self {
        self.at_most_once = on;
        self
    }

    /// The Kafka consumer group id, where it is not the inbox's consumer group (default: the
    /// group). The group stays the runner's (one inbox line); only the Kafka group, which holds
    /// the committed offsets, is named apart, e.g. to start a group's reading afresh.
    pub fn kafka_group_id(mut self, id: impl Into<String>) -> Self {
        self.group_id = Some(id.into());
        self
    }

    /// The client id, the runner's worker id (R175; default the connection's client id).
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = Some(id.into());
        self
    }

    /// Where a group without a committed offset starts (default earliest, R175).
    pub fn offset_reset(mut self, r: OffsetReset) -> Self {
        self.offset_reset = r;
        self
    }

    /// Reads uncommitted records of producer transactions too (default: read_committed).
    pub fn read_uncommitted(mut self) -> Self {
        self.read_committed = false;
        self
    }

    /// The group session timeout: a runner that stops answering loses its partitions after it
    /// (default 10 s; the broker bounds it).
    pub fn session_timeout(mut self, d: Duration) -> Self {
        self.session_timeout = d;
        self
    }

    /// The bound on the wait for runs in flight before a partition is given up at a rebalance
    /// (default 60 s; the runner's handler timeout plus commit_timeout is enough).
    pub fn revoke_timeout(mut self, d: Duration) -> Self {
        self.revoke_timeout = d;
        self
    }

    /// The dead-letter topic suffix (default `.dead-letter`, R140).
    pub fn dead_letter_suffix(mut self, s: impl Into<String>) -> Self {
        self.dead_letter_suffix = s.into();
        self
    }

    /// How many records are read ahead of the runner (default 100); the partitions are paused
    /// while the buffer is full.
    pub fn max_buffered(mut self, n: usize) -> Self {
        self.max_buffered = n;
        self
    }

    fn validate(&self) -> Result<(), KafkaBrokerError> {
        let bad = |m: String| Err(KafkaBrokerError::Config(m));
        self.connection.validate()?;
        if self.group.trim().is_empty() {
            return bad("the subscription's consumer group must not be empty".into());
        }
        if self
            .group_id
            .as_deref()
            .is_some_and(|g| g.trim().is_empty())
        {
            return bad("the subscription's Kafka group id must not be empty".into());
        }
        if self.topics.is_empty() {
            return bad("the subscription needs at least one topic".into());
        }
        for t in &self.topics {
            let full = self.connection.topic_for(t);
            if let Some(p) = crate::record::topic_problem(&full) {
                return bad(format!("topic {full:?} is not a Kafka topic name: {p}"));
            }
        }
        if self.session_timeout < Duration::from_secs(1) {
            return bad("session_timeout must be at least 1 s".into());
        }
        if self.revoke_timeout.is_zero() {
            return bad("revoke_timeout must be positive".into());
        }
        if self.max_buffered == 0 {
            return bad("max_buffered must be at least 1".into());
        }
        Ok(())
    }
}

type Tp = (String, i32);

/// What the subscription knows of one partition it holds.
struct Part {
    /// Which holding of the partition this is; a delivery of an earlier one cannot end here.
    epoch: u64,
    /// Offsets read (buffered or handed out) and not ended, with how many times each is open.
    open: BTreeMap<i64, u32>,
    /// The offset after the last record read.
    next_read: Option<i64>,
    /// The last committed offset.
    committed: Option<i64>,
    /// The lowest rewound offset, while a rewind waits: no commit passes it.
    hold: Option<i64>,
    /// When the partition is sought back to `hold` and resumed.
    resume_at: Option<Instant>,
    /// Deliveries handed out per offset (n, R176).
    started: HashMap<i64, u32>,
    /// Being taken away: nothing more is handed out.
    revoking: bool,
}

impl Part {
    fn new(epoch: u64) -> Self {
        Self {
            epoch,
            open: BTreeMap::new(),
            next_read: None,
            committed: None,
            hold: None,
            resume_at: None,
            started: HashMap::new(),
            revoking: false,
        }
    }

    /// The offset to commit: the lowest offset not ended (R176).
    fn target(&self) -> Option<i64> {
        [self.open.keys().next().copied(), self.hold, self.next_read]
            .into_iter()
            .flatten()
            .min()
    }

    fn close_one(&mut self, offset: i64) {
        if let Some(c) = self.open.get_mut(&offset) {
            *c -= 1;
            if *c == 0 {
                self.open.remove(&offset);
            }
        }
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<ConsumerRecord>,
    parts: HashMap<Tp, Part>,
    epochs: u64,
    flow_paused: bool,
    poll_error: Option<String>,
}

impl State {
    /// Sets aside the buffered records of `tp` at or after `from` (all of them for none).
    fn set_aside(&mut self, tp: &Tp, from: Option<i64>) {
        let mut kept = VecDeque::with_capacity(self.queue.len());
        let mut dropped = Vec::new();
        for r in self.queue.drain(..) {
            if *r.topic == *tp.0 && r.partition == tp.1 && from.is_none_or(|f| r.offset >= f) {
                dropped.push(r.offset);
            } else {
                kept.push_back(r);
            }
        }
        self.queue = kept;
        if let Some(p) = self.parts.get_mut(tp) {
            // They are read again: the next read, and so the commit, stops at the first.
            if let Some(first) = dropped.iter().min() {
                p.next_read = Some(p.next_read.map_or(*first, |n| n.min(*first)));
            }
            for o in dropped {
                p.close_one(o);
            }
        }
    }
}

struct Shared {
    state: Mutex<State>,
    changed: tokio::sync::Notify,
    commit_lock: tokio::sync::Mutex<()>,
    consumer: OnceLock<Weak<Consumer>>,
    revoke_timeout: Duration,
    at_most_once: bool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn consumer(&self) -> Option<Arc<Consumer>> {
        self.consumer.get().and_then(Weak::upgrade)
    }

    /// Commits the progress of `tp` when its lowest offset not ended moved past the last
    /// commit (R176); commits leave one at a time, each computed under the lock.
    async fn commit_progress(&self, tp: &Tp) -> Result<(), SubscriptionError> {
        let _one = self.commit_lock.lock().await;
        let target = {
            let st = self.lock();
            let Some(p) = st.parts.get(tp) else {
                return Ok(());
            };
            match p.target() {
                Some(t) if p.committed.is_none_or(|c| t > c) => t,
                _ => return Ok(()),
            }
        };
        let consumer = self
            .consumer()
            .ok_or_else(|| SubscriptionError::transient("Kafka: the subscription is closed"))?;
        let tp_ = TopicPartition::new(tp.0.clone(), tp.1);
        consumer
            .commit_offsets([(tp_, OffsetAndMetadata::new(target))])
            .await
            .map_err(|e| {
                SubscriptionError::transient(format!(
                    "Kafka: the offset commit of {}-{} at {target} failed: {e}",
                    tp.0, tp.1
                ))
            })?;
        if let Some(p) = self.lock().parts.get_mut(tp) {
            p.committed = Some(p.committed.map_or(target, |c| c.max(target)));
            p.started.retain(|o, _| *o >= target);
        }
        self.changed.notify_waiters();
        Ok(())
    }
}

/// Applies the group's assignment changes to the subscription's partitions (R176's rebalance).
struct Listener {
    shared: Arc<Shared>,
}

impl ConsumerRebalanceListener for Listener {
    async fn on_partitions_assigned(&self, partitions: &[TopicPartition]) {
        let mut st = self.shared.lock();
        for tp in partitions {
            st.epochs += 1;
            let e = st.epochs;
            st.parts
                .insert((tp.topic.clone(), tp.partition), Part::new(e));
        }
        tracing::info!(?partitions, "Kafka inbox: partitions assigned");
    }

    async fn on_partitions_revoked(&self, partitions: &[TopicPartition]) {
        let tps: Vec<Tp> = partitions
            .iter()
            .map(|t| (t.topic.clone(), t.partition))
            .collect();
        {
            let mut st = self.shared.lock();
            for tp in &tps {
                st.set_aside(tp, None);
                if let Some(p) = st.parts.get_mut(tp) {
                    p.revoking = true;
                    // A rewind waiting is dropped; its hold keeps the commit at or before it.
                    p.resume_at = None;
                }
            }
        }
        // Runs in flight finish (bounded), then the progress is committed.
        let deadline = Instant::now() + self.shared.revoke_timeout;
        loop {
            let notified = self.shared.changed.notified();
            let running = {
                let st = self.shared.lock();
                tps.iter()
                    .filter_map(|tp| st.parts.get(tp))
                    .any(|p| !p.open.is_empty())
            };
            if !running || Instant::now() >= deadline {
                break;
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
        for tp in &tps {
            if let Err(e) = self.shared.commit_progress(tp).await {
                tracing::warn!(error = %e, "Kafka inbox: the commit before giving up a partition failed");
            }
        }
        let mut st = self.shared.lock();
        for tp in &tps {
            st.parts.remove(tp);
        }
        tracing::info!(?partitions, "Kafka inbox: partitions revoked");
    }

    async fn on_partitions_lost(&self, partitions: &[TopicPartition]) {
        let mut st = self.shared.lock();
        for t in partitions {
            let tp = (t.topic.clone(), t.partition);
            st.set_aside(&tp, None);
            st.parts.remove(&tp);
        }
        tracing::warn!(?partitions, "Kafka inbox: partitions lost");
    }
}

struct Inner {
    shared: Arc<Shared>,
    consumer: Arc<Consumer>,
    producer: Producer,
    group: String,
    /// The config's topics, without the prefix (the runner's default sources, R121).
    topics: Vec<String>,
    topic_prefix: String,
    dead_letter_suffix: String,
    cancel: tokio_util::sync::CancellationToken,
    poller: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Stops the poller when the last handle of a subscription is dropped (a killed runner): the
/// consumer is then dropped without leaving the group, as a crash would (R176).
struct DropGuard(tokio_util::sync::CancellationToken);

impl Drop for DropGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The inbox's subscription on a Kafka consumer group (R175, R176). Cloning shares it; each
/// runner of a group needs its own subscription (its own group member).
#[derive(Clone)]
pub struct KafkaSubscription {
    inner: Arc<Inner>,
    _guard: Arc<DropGuard>,
}

impl std::fmt::Debug for KafkaSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSubscription")
            .field("group", &self.inner.group)
            .finish_non_exhaustive()
    }
}

fn transient(what: &str, e: impl std::fmt::Display) -> SubscriptionError {
    SubscriptionError::transient(format!("Kafka: {what} failed: {e}"))
}

impl KafkaSubscription {
    /// Connects, subscribes as a member of the group and starts reading. Fails with a
    /// configuration error for bad settings and a connection error when no broker answers.
    pub async fn connect(config: KafkaSubscriptionConfig) -> Result<Self, KafkaBrokerError> {
        config.validate()?;
        let c = &config.connection;
        let connect_error = |e: krafka::error::KrafkaError| KafkaBrokerError::Connect {
            brokers: c.brokers.clone(),
            message: e.to_string(),
        };
        let client_id = config
            .client_id
            .clone()
            .unwrap_or_else(|| c.client_id.clone());
        // The dead-letter producer's delivery timeout must cover linger + one request.
        let request_timeout =
            (c.delivery_timeout - c.linger - Duration::from_millis(5)).min(Duration::from_secs(30));
        let mut b = Kafka::builder(c.brokers.clone())
            .client_id(client_id)
            .request_timeout(request_timeout)
            .connect_timeout(c.connect_timeout.min(request_timeout))
            .allow_auto_create_topics(false);
        if let Some(a) = crate::auth_config(c) {
            b = b.security(a);
        }
        let kafka = b.connect().await.map_err(connect_error)?;
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            changed: tokio::sync::Notify::new(),
            commit_lock: tokio::sync::Mutex::new(()),
            consumer: OnceLock::new(),
            revoke_timeout: config.revoke_timeout,
            at_most_once: config.at_most_once,
        });
        let consumer = kafka
            .consumer(
                config
                    .group_id
                    .clone()
                    .unwrap_or_else(|| config.group.clone()),
            )
            .enable_auto_commit(false)
            .auto_offset_reset(match config.offset_reset {
                OffsetReset::Earliest => AutoOffsetReset::Earliest,
                OffsetReset::Latest => AutoOffsetReset::Latest,
            })
            .isolation_level(if config.read_committed {
                IsolationLevel::ReadCommitted
            } else {
                IsolationLevel::ReadUncommitted
            })
            .session_timeout(config.session_timeout)
            .heartbeat_interval((config.session_timeout / 4).min(Duration::from_millis(500)))
            .fetch_max_wait(Duration::from_millis(100))
            .metrics_push(false)
            .rebalance_listener(Listener {
                shared: shared.clone(),
            })
            .build()
            .await
            .map_err(connect_error)?;
        let consumer = Arc::new(consumer);
        let _ = shared.consumer.set(Arc::downgrade(&consumer));
        let topics: Vec<String> = config.topics.iter().map(|t| c.topic_for(t)).collect();
        consumer.subscribe(&topics).await.map_err(|e| {
            KafkaBrokerError::Config(format!("Kafka: subscribing to {topics:?} failed: {e}"))
        })?;
        let producer = kafka
            .producer()
            .acks(Acks::All)
            .idempotent(c.idempotence == Idempotence::On)
            .linger(c.linger)
            .delivery_timeout(c.delivery_timeout)
            .metrics_push(false)
            .build()
            .await
            .map_err(connect_error)?;
        let cancel = tokio_util::sync::CancellationToken::new();
        let inner = Arc::new(Inner {
            shared,
            consumer,
            producer,
            group: config.group,
            topics: config.topics,
            topic_prefix: c.topic_prefix.clone(),
            dead_letter_suffix: config.dead_letter_suffix,
            cancel: cancel.clone(),
            poller: tokio::sync::Mutex::new(None),
        });
        let task = tokio::spawn(poll_loop(
            inner.consumer.clone(),
            inner.shared.clone(),
            cancel.clone(),
            config.max_buffered,
        ));
        *inner.poller.lock().await = Some(task);
        Ok(Self {
            inner,
            _guard: Arc::new(DropGuard(cancel)),
        })
    }

    /// The group's committed offset of a partition (for tests and operators); none when the
    /// group has none.
    pub async fn committed(
        &self,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i64>, SubscriptionError> {
        let m = self
            .inner
            .consumer
            .committed(&[(topic, partition)])
            .await
            .map_err(|e| transient("reading the committed offset", e))?;
        Ok(m.get(&(topic.to_owned(), partition)).map(|c| c.offset))
    }

    /// The partitions this member holds now.
    pub async fn assignment(&self) -> Vec<(String, i32)> {
        let mut v: Vec<(String, i32)> = self
            .inner
            .consumer
            .assignment()
            .await
            .into_iter()
            .flat_map(|(t, ps)| ps.into_iter().map(move |p| (t.clone(), p)))
            .collect();
        v.sort();
        v
    }

    fn delivery(&self, r: ConsumerRecord) -> Option<InboxDelivery> {
        let tp: Tp = (r.topic.to_string(), r.partition);
        let (n, epoch) = {
            let mut st = self.inner.shared.lock();
            let p = st.parts.get_mut(&tp)?;
            if p.revoking || p.hold.is_some_and(|h| r.offset >= h) {
                p.close_one(r.offset);
                return None;
            }
            let n = p.started.entry(r.offset).or_insert(0);
            *n += 1;
            (*n, p.epoch)
        };
        let message = BrokerMessage::Kafka {
            topic: tp.0.clone(),
            topic_prefix: self.inner.topic_prefix.clone(),
            partition: r.partition,
            offset: r.offset,
            key: r.key.as_ref().map(|k| k.to_vec()),
            headers: r
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), v.as_ref().map(|v| v.to_vec())))
                .collect(),
            value: r.value.as_ref().map(|v| v.to_vec()),
        };
        Some(InboxDelivery {
            message,
            delivery_number: n,
            redelivered_later: true,
            ack: Arc::new(KafkaAck {
                inner: self.inner.clone(),
                tp,
                epoch,
                record: r,
            }),
        })
    }
}

/// Keeps polling: serves the group session and rebalances, seeks rewound partitions back once
/// their delay passed, and pauses the partitions while the buffer is full.
async fn poll_loop(
    consumer: Arc<Consumer>,
    shared: Arc<Shared>,
    cancel: tokio_util::sync::CancellationToken,
    max_buffered: usize,
) {
    let mut failures = 0u32;
    while !cancel.is_cancelled() {
        // Rewinds whose delay passed: seek back to the rewound record and resume (R176).
        let now = Instant::now();
        let due: Vec<(Tp, i64)> = {
            let st = shared.lock();
            st.parts
                .iter()
                .filter(|(_, p)| p.resume_at.is_some_and(|t| t <= now))
                .filter_map(|(tp, p)| p.hold.map(|h| (tp.clone(), h)))
                .collect()
        };
        for (tp, h) in due {
            match consumer.seek(&tp.0, tp.1, h).await {
                Ok(()) => {
                    consumer.resume(&tp.0, &[tp.1]).await;
                    let mut st = shared.lock();
                    st.set_aside(&tp, Some(h));
                    if let Some(p) = st.parts.get_mut(&tp) {
                        p.hold = None;
                        p.resume_at = None;
                        p.next_read = Some(h);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Kafka inbox: seeking a rewound partition back failed")
                }
            }
        }
        // Flow control: no fetch while the buffer is full (held partitions stay paused).
        let (full, was, free): (bool, bool, Vec<Tp>) = {
            let st = shared.lock();
            (
                st.queue.len() >= max_buffered,
                st.flow_paused,
                st.parts
                    .iter()
                    .filter(|(_, p)| p.hold.is_none())
                    .map(|(tp, _)| tp.clone())
                    .collect(),
            )
        };
        if full != was {
            for tp in &free {
                if full {
                    consumer.pause(&tp.0, &[tp.1]).await;
                } else {
                    consumer.resume(&tp.0, &[tp.1]).await;
                }
            }
            shared.lock().flow_paused = full;
        }
        let polled = tokio::select! {
            () = cancel.cancelled() => break,
            r = consumer.poll(Duration::from_millis(100)) => r,
        };
        match polled {
            Ok(records) => {
                failures = 0;
                if records.is_empty() {
                    continue;
                }
                let mut st = shared.lock();
                st.poll_error = None;
                for r in records {
                    let tp: Tp = (r.topic.to_string(), r.partition);
                    let Some(p) = st.parts.get_mut(&tp) else {
                        continue;
                    };
                    if p.revoking || p.hold.is_some_and(|h| r.offset >= h) {
                        continue;
                    }
                    p.next_read = Some(r.offset + 1);
                    *p.open.entry(r.offset).or_insert(0) += 1;
                    st.queue.push_back(r);
                }
                drop(st);
                shared.changed.notify_waiters();
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "Kafka inbox: a poll failed");
                shared.lock().poll_error = Some(e.to_string());
                shared.changed.notify_waiters();
                let wait = Duration::from_millis(100 * u64::from(failures.min(20)));
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

#[async_trait]
impl Subscription for KafkaSubscription {
    fn capabilities(&self) -> SubscriptionCapabilities {
        SubscriptionCapabilities {
            name: "kafka",
            rewind: false,
            last_delivery: false,
            renew_every: None,
            // R175's text.
            rewind_refusal: Some(
                "on_failure rewind is refused on Kafka: a rewind holds its whole partition",
            ),
        }
    }

    /// The config's consumer group: the runner's (`Runner::for_subscription` takes it).
    fn group(&self) -> Option<&str> {
        Some(&self.inner.group)
    }

    /// The config's topics (read under the topic prefix): the runner's default sources (R121).
    fn topics(&self) -> Option<&[String]> {
        Some(&self.inner.topics)
    }

    /// Up to `max` records from the buffer, waiting at most `wait` for the first.
    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        if max == 0 || self.inner.cancel.is_cancelled() {
            return Ok(Vec::new());
        }
        let deadline = Instant::now() + wait;
        loop {
            let notified = self.inner.shared.changed.notified();
            let (taken, error) = {
                let mut st = self.inner.shared.lock();
                let n = st.queue.len().min(max);
                let taken: Vec<ConsumerRecord> = st.queue.drain(..n).collect();
                (taken, st.poll_error.take())
            };
            let out: Vec<InboxDelivery> =
                taken.into_iter().filter_map(|r| self.delivery(r)).collect();
            if !out.is_empty() {
                return Ok(out);
            }
            if let Some(e) = error {
                return Err(transient("a poll", e));
            }
            if Instant::now() >= deadline {
                return Ok(Vec::new());
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// Stops reading, sets aside the records not handed out, commits the progress of every
    /// partition (the runner let its runs finish), and leaves the group (R167, R176).
    async fn close(&self) {
        self.inner.cancel.cancel();
        if let Some(t) = self.inner.poller.lock().await.take() {
            let _ = t.await;
        }
        let tps: Vec<Tp> = {
            let mut st = self.inner.shared.lock();
            let tps: Vec<Tp> = st.parts.keys().cloned().collect();
            for tp in &tps {
                st.set_aside(tp, None);
            }
            tps
        };
        for tp in &tps {
            if let Err(e) = self.inner.shared.commit_progress(tp).await {
                tracing::warn!(error = %e, "Kafka inbox: the commit at close failed");
            }
        }
        if let Err(e) = self.inner.consumer.close().await {
            tracing::warn!(error = %e, "Kafka inbox: leaving the group failed");
        }
        if let Err(e) = self.inner.producer.close().await {
            tracing::debug!(error = %e, "Kafka inbox: closing the dead-letter producer failed");
        }
    }
}

struct KafkaAck {
    inner: Arc<Inner>,
    tp: Tp,
    epoch: u64,
    record: ConsumerRecord,
}

impl KafkaAck {
    /// Ends the record in its partition; fails when this member no longer holds the partition
    /// it was read from (R176: commit_failed; the new owner reads it again).
    fn end(&self) -> Result<(), SubscriptionError> {
        let mut st = self.inner.shared.lock();
        match st.parts.get_mut(&self.tp) {
            Some(p) if p.epoch == self.epoch => {
                p.close_one(self.record.offset);
                Ok(())
            }
            _ => Err(self.moved()),
        }
    }

    async fn end_and_commit(&self) -> Result<(), SubscriptionError> {
        let r = self.end();
        self.inner.shared.changed.notify_waiters();
        r?;
        self.inner.shared.commit_progress(&self.tp).await?;
        if !self.inner.shared.at_most_once {
            return Ok(());
        }
        // at_most_once: confirmed only once a commit passes the record (R176); the runner
        // bounds the wait by commit_timeout.
        let shared = &self.inner.shared;
        loop {
            let notified = shared.changed.notified();
            let passed = match shared.lock().parts.get(&self.tp) {
                Some(p) if p.epoch == self.epoch => {
                    p.committed.is_some_and(|c| c > self.record.offset)
                }
                _ => return Err(self.moved()),
            };
            if passed {
                return Ok(());
            }
            notified.await;
        }
    }

    fn moved(&self) -> SubscriptionError {
        SubscriptionError::transient(format!(
            "Kafka: partition {}-{} moved to another member of the group; its new owner reads offset {} again",
            self.tp.0, self.tp.1, self.record.offset
        ))
    }
}

#[async_trait]
impl AckHandle for KafkaAck {
    /// The record ends; an OffsetCommit follows when the partition's lowest offset not ended
    /// moved (R176).
    async fn commit(&self) -> Result<(), SubscriptionError> {
        self.end_and_commit().await
    }

    /// Holds the partition: pause, set aside what was read after the record, and after `delay`
    /// seek back to it (R176).
    async fn rewind(&self, delay: Duration) -> Result<(), SubscriptionError> {
        let offset = self.record.offset;
        {
            let mut st = self.inner.shared.lock();
            let p = match st.parts.get_mut(&self.tp) {
                Some(p) if p.epoch == self.epoch => p,
                // The partition moved: the new owner reads from the committed offset, at or
                // before this record.
                _ => return Ok(()),
            };
            p.close_one(offset);
            p.hold = Some(p.hold.map_or(offset, |h| h.min(offset)));
            let at = Instant::now() + delay;
            p.resume_at = Some(p.resume_at.map_or(at, |t| t.max(at)));
            st.set_aside(&self.tp, Some(offset));
        }
        self.inner.consumer.pause(&self.tp.0, &[self.tp.1]).await;
        self.inner.shared.changed.notify_waiters();
        Ok(())
    }

    /// The record ends as by commit (the dead-letter copy came first, R140).
    async fn term(&self, reason: &str) -> Result<(), SubscriptionError> {
        tracing::info!(topic = %self.tp.0, partition = self.tp.1, offset = self.record.offset, reason, "Kafka inbox: record terminated");
        self.end_and_commit().await
    }

    /// Nothing: Kafka has no lease on a record (R176).
    async fn renew(&self) -> Result<(), SubscriptionError> {
        Ok(())
    }

    /// A record to the topic + `.dead-letter` with the key, value and headers as received plus
    /// R140's, acknowledged under acks = all.
    async fn dead_letter(&self, reason: &str, group: &str) -> Result<(), SubscriptionError> {
        let r = &self.record;
        let topic = format!("{}{}", r.topic, self.inner.dead_letter_suffix);
        // The topic must exist (a broker that creates topics on request does not get to).
        let known = tokio::time::timeout(
            DEAD_LETTER_METADATA_WAIT,
            self.inner.producer.partitions_for(&topic),
        )
        .await;
        match known {
            Ok(Ok(p)) if !p.is_empty() => {}
            Ok(Ok(_)) | Ok(Err(_)) | Err(_) => {
                return Err(SubscriptionError::transient(format!(
                    "Kafka: the dead-letter topic {topic:?} does not exist (or no broker answered within {DEAD_LETTER_METADATA_WAIT:?}); create it"
                )));
            }
        }
        let mut out = Record::new(topic.clone(), Vec::<u8>::new()).without_key();
        out = match &r.value {
            Some(v) => out.value(v.clone()),
            None => out.without_value(),
        };
        if let Some(k) = &r.key {
            out = out.key(k.clone());
        }
        for (k, v) in &r.headers {
            out = match v {
                Some(v) => out.header(k.clone(), v.clone()),
                None => out.null_header(k.clone()),
            };
        }
        for (k, v) in [
            ("Inbox-Invalid-Reason", reason.to_owned()),
            ("Inbox-Consumer-Group", group.to_owned()),
            ("Inbox-Original-Topic", r.topic.to_string()),
            ("Inbox-Original-Partition", r.partition.to_string()),
            ("Inbox-Original-Offset", r.offset.to_string()),
        ] {
            out = out.header(k, v.into_bytes());
        }
        let meta = self
            .inner
            .producer
            .send(out)
            .await
            .map_err(|e| transient(&format!("the dead-letter copy to {topic:?}"), e))?;
        if meta.is_persisted() {
            Ok(())
        } else {
            Err(SubscriptionError::transient(format!(
                "Kafka: the broker did not confirm the dead-letter copy to {topic:?}"
            )))
        }
    }
}
