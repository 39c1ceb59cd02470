//! A scripted subscription (feature `testing`): the subscription of the conformance suite, as
//! [`crate::scripted`] is its broker.
//!
//! It delivers the messages it is given, in order, each delivery with its delivery number n and
//! whether it is the broker's last ([`ScriptedSubscription::last_at`]), and records every ack
//! operation. After `rewind(d)` the message comes again, with n + 1, once d has passed on the
//! given clock; a delivery left unended (a killed runner, a failed commit) comes again after
//! `ack_wait`; deliveries due at the same moment come in the order of their first delivery.
//! Several runners can read one subscription through [`ScriptedSubscription::view`]: shared
//! (any runner takes the next delivery) or partitioned by key. A dead-letter destination
//! records copies.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::Notify;

use crate::clock::Clock;
use crate::inbox::decode::{AmqpValue, BrokerMessage};
use crate::inbox::subscription::{
    AckHandle, InboxDelivery, Subscription, SubscriptionCapabilities, SubscriptionError,
};

/// One recorded ack operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckOp {
    /// commit.
    Commit,
    /// rewind(d).
    Rewind(Duration),
    /// term(reason).
    Term(String),
    /// renew.
    Renew,
}

/// A dead-letter copy (R140).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterCopy {
    /// The message as received.
    pub message: BrokerMessage,
    /// `invalid message: …`.
    pub reason: String,
    /// The group.
    pub group: String,
}

/// Which view a key goes to.
pub type Router = Arc<dyn Fn(&str) -> usize + Send + Sync>;

#[derive(Debug)]
struct Msg {
    message: BrokerMessage,
    key: Option<String>,
    n: u32,
    last_at: Option<u32>,
    acks: Vec<AckOp>,
    fail_commits: u32,
}

struct Due {
    idx: usize,
    at: DateTime<Utc>,
    first: usize,
}

#[derive(Default)]
struct State {
    msgs: Vec<Msg>,
    queue: Vec<Due>,
    outstanding: HashMap<u64, (usize, DateTime<Utc>)>,
    next_token: u64,
    dead: Vec<DeadLetterCopy>,
    fail_dead: u32,
    closed: bool,
    router: Option<Router>,
    log: Vec<(usize, AckOp)>,
}

struct Inner {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    ack_wait: Duration,
    changed: Notify,
    renew_every: Mutex<Option<Duration>>,
}

/// The scripted subscription. Cloning shares it.
#[derive(Clone)]
pub struct ScriptedSubscription {
    inner: Arc<Inner>,
    view: Option<usize>,
    group: Option<Arc<str>>,
    topics: Option<Arc<[String]>>,
}

impl std::fmt::Debug for ScriptedSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedSubscription")
            .field("view", &self.view)
            .finish_non_exhaustive()
    }
}

fn plus(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    t + chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

fn key_of(m: &BrokerMessage) -> Option<String> {
    let attrs = match m {
        BrokerMessage::Nats { headers, .. } => headers,
        BrokerMessage::Redis { fields, .. } => fields,
        BrokerMessage::Kafka { .. } => return kafka_key_of(m),
        BrokerMessage::RabbitMq { headers, .. } => {
            return headers.iter().find_map(|(k, v)| match v {
                AmqpValue::Text(s) if k == "partition_key" => Some(s.clone()),
                _ => None,
            });
        }
    };
    attrs
        .iter()
        .find(|(k, _)| k == "partition_key")
        .map(|(_, v)| v.clone())
}

/// A Kafka record's inbox key as decoding gives it (R137, R179), for the router.
fn kafka_key_of(m: &BrokerMessage) -> Option<String> {
    let BrokerMessage::Kafka { headers, key, .. } = m else {
        return None;
    };
    let text = |name: &str| {
        headers
            .iter()
            .find(|(k, v)| {
                k == name && v.as_deref().is_some_and(|v| std::str::from_utf8(v).is_ok())
            })
            .and_then(|(_, v)| String::from_utf8(v.clone()?).ok())
    };
    text("partition_key")
        .or_else(|| text("ce_partitionkey"))
        .or_else(|| crate::inbox::decode::kafka_key_partition_key(key.as_deref()))
}

impl ScriptedSubscription {
    /// A subscription on `clock` with ack_wait 30 s.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_ack_wait(clock, Duration::from_secs(30))
    }

    /// A subscription with this ack_wait.
    pub fn with_ack_wait(clock: Arc<dyn Clock>, ack_wait: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                clock,
                ack_wait,
                changed: Notify::new(),
                renew_every: Mutex::new(None),
            }),
            view: None,
            group: None,
            topics: None,
        }
    }

    /// Names the consumer group and the topics the subscription reads for, as a broker
    /// subscription's config does ([`Subscription::group`], [`Subscription::topics`]); without
    /// this it names neither.
    pub fn for_group<S: Into<String>>(
        mut self,
        group: impl Into<String>,
        topics: impl IntoIterator<Item = S>,
    ) -> Self {
        self.group = Some(Arc::from(group.into()));
        self.topics = Some(topics.into_iter().map(Into::into).collect());
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().expect("subscription poisoned")
    }

    /// Has runners renew their held deliveries every `d` of tokio's clock (default never).
    pub fn renew_every(&self, d: Duration) {
        *self.inner.renew_every.lock().expect("poisoned") = Some(d);
    }

    /// The view of runner `i` (for a partitioned subscription; a shared one ignores it).
    pub fn view(&self, i: usize) -> Self {
        Self {
            inner: self.inner.clone(),
            view: Some(i),
            group: self.group.clone(),
            topics: self.topics.clone(),
        }
    }

    /// Key k goes only to view `f(k)`; messages without a key go to any view.
    pub fn partitioned(&self, f: Router) {
        self.lock().router = Some(f);
    }

    /// Queues a message for its first delivery; returns its index.
    pub fn push(&self, message: BrokerMessage) -> usize {
        let now = self.inner.clock.now();
        let mut st = self.lock();
        let idx = st.msgs.len();
        st.msgs.push(Msg {
            key: key_of(&message),
            message,
            n: 0,
            last_at: None,
            acks: Vec::new(),
            fail_commits: 0,
        });
        st.queue.push(Due {
            idx,
            at: now,
            first: idx,
        });
        drop(st);
        self.inner.changed.notify_waiters();
        idx
    }

    /// Delivers message `idx` again (with n + 1).
    pub fn duplicate(&self, idx: usize) {
        let now = self.inner.clock.now();
        self.lock().queue.push(Due {
            idx,
            at: now,
            first: idx,
        });
        self.inner.changed.notify_waiters();
    }

    /// The next commit of `idx` fails; the message then comes back after ack_wait.
    pub fn fail_commit(&self, idx: usize) {
        self.lock().msgs[idx].fail_commits += 1;
    }

    /// The n-th delivery of `idx` is the broker's last.
    pub fn last_at(&self, idx: usize, n: u32) {
        self.lock().msgs[idx].last_at = Some(n);
    }

    /// The next dead-letter copy fails.
    pub fn fail_dead_letter(&self) {
        self.lock().fail_dead += 1;
    }

    /// The ack operations of message `idx`, in order.
    pub fn acks(&self, idx: usize) -> Vec<AckOp> {
        self.lock().msgs[idx].acks.clone()
    }

    /// Every ack operation, in order, with its message's index.
    pub fn log(&self) -> Vec<(usize, AckOp)> {
        self.lock().log.clone()
    }

    /// How often `idx` was delivered.
    pub fn deliveries(&self, idx: usize) -> u32 {
        self.lock().msgs[idx].n
    }

    /// The dead-letter copies.
    pub fn dead_letters(&self) -> Vec<DeadLetterCopy> {
        self.lock().dead.clone()
    }

    /// Whether the subscription was closed.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Whether nothing is queued or outstanding (every delivery ended).
    pub fn is_drained(&self) -> bool {
        let st = self.lock();
        st.queue.is_empty() && st.outstanding.is_empty()
    }

    /// Whether a delivery is due now for this view.
    fn take(&self, max: usize) -> Vec<InboxDelivery> {
        let now = self.inner.clock.now();
        let mut st = self.lock();
        // Unended deliveries older than ack_wait come back (a crash, a failed commit).
        let expired: Vec<u64> = st
            .outstanding
            .iter()
            .filter(|(_, (_, at))| plus(*at, self.inner.ack_wait) <= now)
            .map(|(t, _)| *t)
            .collect();
        for t in expired {
            if let Some((idx, at)) = st.outstanding.remove(&t) {
                st.queue.push(Due {
                    idx,
                    at: plus(at, self.inner.ack_wait),
                    first: idx,
                });
            }
        }
        let router = st.router.clone();
        let view = self.view;
        let mut due: Vec<usize> = (0..st.queue.len())
            .filter(|&i| st.queue[i].at <= now)
            .filter(|&i| match (&router, view, &st.msgs[st.queue[i].idx].key) {
                (Some(r), Some(v), Some(k)) => r(k) == v,
                _ => true,
            })
            .collect();
        due.sort_by_key(|&i| (st.queue[i].at, st.queue[i].first, i));
        due.truncate(max);
        due.sort_unstable_by(|a, b| b.cmp(a));
        let mut picked: Vec<Due> = due.into_iter().map(|i| st.queue.remove(i)).collect();
        picked.sort_by_key(|d| (d.at, d.first));
        let mut out = Vec::with_capacity(picked.len());
        for d in picked {
            let token = st.next_token;
            st.next_token += 1;
            st.outstanding.insert(token, (d.idx, now));
            let m = &mut st.msgs[d.idx];
            m.n += 1;
            out.push(InboxDelivery {
                message: m.message.clone(),
                delivery_number: m.n,
                redelivered_later: m.last_at != Some(m.n),
                ack: Arc::new(ScriptedAck {
                    inner: self.inner.clone(),
                    idx: d.idx,
                    token,
                }),
            });
        }
        out
    }
}

#[async_trait]
impl Subscription for ScriptedSubscription {
    fn capabilities(&self) -> SubscriptionCapabilities {
        SubscriptionCapabilities {
            name: "scripted",
            rewind: true,
            last_delivery: true,
            renew_every: *self.inner.renew_every.lock().expect("poisoned"),
            rewind_refusal: None,
        }
    }

    fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    fn topics(&self) -> Option<&[String]> {
        self.topics.as_deref()
    }

    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        if self.lock().closed || max == 0 {
            return Ok(Vec::new());
        }
        let notified = self.inner.changed.notified();
        let got = self.take(max);
        if !got.is_empty() || wait.is_zero() {
            return Ok(got);
        }
        let _ = tokio::time::timeout(wait, notified).await;
        Ok(self.take(max))
    }

    async fn close(&self) {
        self.lock().closed = true;
    }
}

struct ScriptedAck {
    inner: Arc<Inner>,
    idx: usize,
    token: u64,
}

impl ScriptedAck {
    fn record(&self, st: &mut State, op: AckOp) {
        st.msgs[self.idx].acks.push(op.clone());
        st.log.push((self.idx, op));
    }
}

#[async_trait]
impl AckHandle for ScriptedAck {
    async fn commit(&self) -> Result<(), SubscriptionError> {
        let mut st = self.inner.state.lock().expect("poisoned");
        self.record(&mut st, AckOp::Commit);
        if st.msgs[self.idx].fail_commits > 0 {
            st.msgs[self.idx].fail_commits -= 1;
            return Err(SubscriptionError::transient(
                "injected commit failure (fail_commit)",
            ));
        }
        st.outstanding.remove(&self.token);
        Ok(())
    }

    async fn rewind(&self, delay: Duration) -> Result<(), SubscriptionError> {
        let now = self.inner.clock.now();
        let mut st = self.inner.state.lock().expect("poisoned");
        self.record(&mut st, AckOp::Rewind(delay));
        if st.outstanding.remove(&self.token).is_some() {
            st.queue.push(Due {
                idx: self.idx,
                at: plus(now, delay),
                first: self.idx,
            });
        }
        drop(st);
        self.inner.changed.notify_waiters();
        Ok(())
    }

    async fn term(&self, reason: &str) -> Result<(), SubscriptionError> {
        let mut st = self.inner.state.lock().expect("poisoned");
        self.record(&mut st, AckOp::Term(reason.to_owned()));
        st.outstanding.remove(&self.token);
        Ok(())
    }

    async fn renew(&self) -> Result<(), SubscriptionError> {
        let now = self.inner.clock.now();
        let mut st = self.inner.state.lock().expect("poisoned");
        self.record(&mut st, AckOp::Renew);
        if let Some(o) = st.outstanding.get_mut(&self.token) {
            o.1 = now;
        }
        Ok(())
    }

    async fn dead_letter(&self, reason: &str, group: &str) -> Result<(), SubscriptionError> {
        let mut st = self.inner.state.lock().expect("poisoned");
        if st.fail_dead > 0 {
            st.fail_dead -= 1;
            return Err(SubscriptionError::transient(
                "injected dead-letter failure (fail_dead_letter)",
            ));
        }
        let message = st.msgs[self.idx].message.clone();
        st.dead.push(DeadLetterCopy {
            message,
            reason: reason.to_owned(),
            group: group.to_owned(),
        });
        Ok(())
    }
}

/// Builds the suite's messages: NATS kind (stream `S`, subject `in.src`, prefix `in.`) or Redis
/// kind (stream key `in:src`, prefix `in:`), numbering positions.
#[derive(Debug, Default)]
pub struct MessageFactory {
    seq: std::sync::atomic::AtomicU64,
}

impl MessageFactory {
    /// A factory starting at sequence 1.
    pub fn new() -> Self {
        Self::default()
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
    }

    /// A NATS message on `in.src` with these headers and body.
    pub fn nats(&self, headers: &[(&str, &str)], body: &str) -> BrokerMessage {
        BrokerMessage::Nats {
            stream: "S".into(),
            sequence: self.next_seq(),
            subject: "in.src".into(),
            subject_prefix: "in.".into(),
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.as_bytes().to_vec(),
        }
    }

    /// A RabbitMQ delivery from queue `q` (exchange `""`, routing key `in.src`, prefix `in.`)
    /// with these properties (message_id, type), typed headers and body; it has no position.
    pub fn rabbitmq(
        &self,
        message_id: Option<&str>,
        kind: Option<&str>,
        headers: Vec<(&str, AmqpValue)>,
        body: &str,
    ) -> BrokerMessage {
        BrokerMessage::RabbitMq {
            queue: "q".into(),
            exchange: String::new(),
            routing_key: "in.src".into(),
            routing_key_prefix: "in.".into(),
            message_id: message_id.map(str::to_owned),
            kind: kind.map(str::to_owned),
            headers: headers
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            body: body.as_bytes().to_vec(),
            redelivered: false,
        }
    }

    /// A Redis entry on `in:src` with these fields.
    pub fn redis(&self, fields: &[(&str, &str)]) -> BrokerMessage {
        BrokerMessage::Redis {
            stream_key: "in:src".into(),
            key_prefix: "in:".into(),
            entry_id: format!("1700000000000-{}", self.next_seq() - 1),
            fields: fields
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    /// A Kafka record on `in.src` (topic prefix `in.`) of partition `partition`, at the next
    /// offset (from 0), with these headers (a none value is a null header value), key and value
    /// (none: a tombstone).
    pub fn kafka(
        &self,
        partition: i32,
        headers: &[(&str, Option<&[u8]>)],
        key: Option<&[u8]>,
        value: Option<&str>,
    ) -> BrokerMessage {
        BrokerMessage::Kafka {
            topic: "in.src".into(),
            topic_prefix: "in.".into(),
            partition,
            offset: i64::try_from(self.next_seq() - 1).unwrap_or(i64::MAX),
            key: key.map(<[u8]>::to_vec),
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.map(<[u8]>::to_vec)))
                .collect(),
            value: value.map(|v| v.as_bytes().to_vec()),
        }
    }
}
