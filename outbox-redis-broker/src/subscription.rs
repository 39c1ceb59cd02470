//! The inbox's Redis Streams subscription (contract R135, R136, R137, R140).
//!
//! [`RedisSubscription`] reads the streams prefix + topic in one consumer group as the consumer
//! named by the runner's worker id. A missing group is created at `0` with MKSTREAM, so entries
//! written before it are read. On start it reads its own pending entries first (id `0`), then
//! new ones (`>`), with BLOCK (default claim_idle / 4) on a connection of its own; commits,
//! renewals and claims use another connection, so none waits behind a blocking read.
//!
//! | operation | Redis |
//! |---|---|
//! | commit, term | XACK (a reply of 0 counts as committed) |
//! | rewind(d) | no XACK: the entry stays pending under this consumer, renewed until d has passed, then claimed again with XCLAIM (which counts a delivery) |
//! | renew | XCLAIM to itself with JUSTID and min-idle = the time since this runner's last answer about the entry; an entry it does not return has passed to another consumer |
//! | claims | every claim_idle / 2, XAUTOCLAIM of entries idle for claim_idle |
//! | dead-letter copy | XADD to `{stream}:dead-letter` with the fields plus `invalid_reason`, `consumer_group`, `original_stream`, `original_id`, and XACK, in one MULTI/EXEC |
//!
//! The delivery number is the entry's count in the pending entries list (XPENDING, one call per
//! read or claim). Redis has no last delivery. At a clean stop the consumer is deleted from the
//! group when it has no pending entry. Checked by J-08 to J-13, J-32 and the G scenarios in
//! `outbox-conformance`'s broker trials.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;
use txoutbox_core::inbox::decode::BrokerMessage;
use txoutbox_core::inbox::subscription::{
    AckHandle, InboxDelivery, Subscription, SubscriptionCapabilities, SubscriptionError,
};

use crate::RedisBrokerError;

/// Default claim_idle (R136).
pub const DEFAULT_CLAIM_IDLE: Duration = Duration::from_secs(60);
/// Default suffix of the dead-letter stream (R140).
pub const DEFAULT_DEAD_LETTER_SUFFIX: &str = ":dead-letter";

/// Settings of a [`RedisSubscription`].
#[derive(Clone, PartialEq, Eq)]
pub struct RedisSubscriptionConfig {
    url: String,
    group: String,
    consumer: String,
    key_prefix: String,
    topics: Vec<String>,
    claim_idle: Duration,
    block: Option<Duration>,
    create_group: bool,
    dead_letter_suffix: String,
    timeout: Duration,
    max_waiting_rewinds: usize,
}

impl std::fmt::Debug for RedisSubscriptionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSubscriptionConfig")
            .field("url", &txoutbox_core::redact::secrets(&self.url))
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("key_prefix", &self.key_prefix)
            .field("topics", &self.topics)
            .field("claim_idle", &self.claim_idle)
            .finish_non_exhaustive()
    }
}

impl RedisSubscriptionConfig {
    /// Reads the streams prefix + topic of `topics` at `url` in group `group` as consumer
    /// `consumer` (the runner's worker id), with claim_idle 60 s and BLOCK claim_idle / 4.
    pub fn new<S: Into<String>>(
        url: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
        topics: impl IntoIterator<Item = S>,
    ) -> Self {
        Self {
            url: url.into(),
            group: group.into(),
            consumer: consumer.into(),
            key_prefix: String::new(),
            topics: topics.into_iter().map(Into::into).collect(),
            claim_idle: DEFAULT_CLAIM_IDLE,
            block: None,
            create_group: true,
            dead_letter_suffix: DEFAULT_DEAD_LETTER_SUFFIX.into(),
            timeout: crate::DEFAULT_TIMEOUT,
            max_waiting_rewinds: txoutbox_core::inbox::runner::DEFAULT_RUNNER_CONCURRENCY,
        }
    }

    /// The key prefix of the streams (R53), e.g. `in:`.
    pub fn key_prefix(mut self, p: impl Into<String>) -> Self {
        self.key_prefix = p.into();
        self
    }

    /// How long an entry must be idle before another runner of the group claims it (≥ 1 s,
    /// default 60 s). Renewals and claims go every half of it.
    pub fn claim_idle(mut self, d: Duration) -> Self {
        self.claim_idle = d;
        self
    }

    /// The BLOCK time of a read (shorter than claim_idle / 2; default claim_idle / 4).
    pub fn block(mut self, d: Duration) -> Self {
        self.block = Some(d);
        self
    }

    /// Whether a missing group is created at `0` with MKSTREAM (default true).
    pub fn create_group(mut self, on: bool) -> Self {
        self.create_group = on;
        self
    }

    /// The dead-letter stream's suffix (default `:dead-letter`).
    pub fn dead_letter_suffix(mut self, s: impl Into<String>) -> Self {
        self.dead_letter_suffix = s.into();
        self
    }

    /// How many rewinds may wait at once (R136; ≥ 1, default 16, the runner's default
    /// concurrency: set it to the runner's concurrency). Beyond it, a handler failure the rewind
    /// policy would rewind is recorded in the row instead, and a rewind after a persistence error
    /// or a failed dead-letter copy (R132, R140) is left pending without a timer: it comes back
    /// through XAUTOCLAIM after claim_idle. This bounds what a long database outage can pile up.
    pub fn max_waiting_rewinds(mut self, n: usize) -> Self {
        self.max_waiting_rewinds = n;
        self
    }

    /// The bound on one command that does not block (default 10 s).
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    fn block_time(&self) -> Duration {
        self.block.unwrap_or(self.claim_idle / 4)
    }

    fn validate(&self) -> Result<(), RedisBrokerError> {
        let bad = |m: String| Err(RedisBrokerError::Config(m));
        if self.topics.is_empty() {
            return bad("the subscription needs at least one topic".into());
        }
        if self.group.trim().is_empty() || self.consumer.trim().is_empty() {
            return bad("the consumer group and the consumer (worker id) must not be empty".into());
        }
        if self.claim_idle < Duration::from_secs(1) {
            return bad("claim_idle must be at least 1 s".into());
        }
        if self.block_time().is_zero() || self.block_time() >= self.claim_idle / 2 {
            return bad("block must be > 0 and shorter than claim_idle / 2".into());
        }
        if self.max_waiting_rewinds == 0 {
            return bad("max_waiting_rewinds must be at least 1".into());
        }
        if self.timeout.is_zero() {
            return bad("timeout must be > 0".into());
        }
        Ok(())
    }
}

/// When this runner last had an answer about an entry (R136's min-idle), and whether the entry
/// passed to another consumer.
#[derive(Debug)]
struct Touch {
    at: Mutex<Instant>,
    lost: AtomicBool,
}

impl Touch {
    fn new(at: Instant) -> Arc<Self> {
        Arc::new(Self {
            at: Mutex::new(at),
            lost: AtomicBool::new(false),
        })
    }
    fn since(&self) -> Duration {
        self.at.lock().expect("poisoned").elapsed()
    }
    fn set(&self, at: Instant) {
        *self.at.lock().expect("poisoned") = at;
    }
}

/// An entry to renew: stream, id, its touch.
type Renewal = (String, String, Arc<Touch>);

struct Rewind {
    stream: String,
    id: String,
    due: Instant,
    touch: Arc<Touch>,
}

#[derive(Default)]
struct State {
    /// Per stream, the cursor of the own-pending phase; none once it is over.
    own_cursor: HashMap<String, Option<String>>,
    rewinds: Vec<Rewind>,
    last_autoclaim: Option<Instant>,
}

struct Inner {
    ops: ConnectionManager,
    reader: tokio::sync::Mutex<ConnectionManager>,
    config: RedisSubscriptionConfig,
    streams: Vec<String>,
    state: Mutex<State>,
    /// Deliveries a read brought after its caller stopped waiting (the runner's read is
    /// cancelled when another branch of its loop wins); handed out by the next read.
    buffer: Mutex<std::collections::VecDeque<InboxDelivery>>,
    /// Held by a read task for its duration; a close waits for it.
    reading: tokio::sync::Mutex<()>,
    closed: AtomicBool,
}

/// The inbox's subscription on a Redis Streams consumer group (R135, R136). Cloning shares it.
#[derive(Clone)]
pub struct RedisSubscription {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSubscription")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

fn connect_error(config: &RedisSubscriptionConfig, e: impl std::fmt::Display) -> RedisBrokerError {
    RedisBrokerError::Connect {
        url: txoutbox_core::redact::secrets(&config.url),
        message: txoutbox_core::redact::secrets(&e.to_string()),
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> SubscriptionError {
    SubscriptionError::transient(format!("Redis: {what} failed: {e}"))
}

impl RedisSubscription {
    /// Connects two connections (one for blocking reads) and creates the group of every stream
    /// when it is missing (R135).
    pub async fn connect(config: RedisSubscriptionConfig) -> Result<Self, RedisBrokerError> {
        config.validate()?;
        let client =
            redis::Client::open(config.url.as_str()).map_err(|e| connect_error(&config, e))?;
        let mk = |response: Duration| {
            ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.timeout))
                .set_response_timeout(Some(response))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500))
        };
        let ops = ConnectionManager::new_with_config(client.clone(), mk(config.timeout))
            .await
            .map_err(|e| connect_error(&config, e))?;
        let reader =
            ConnectionManager::new_with_config(client, mk(config.block_time() + config.timeout))
                .await
                .map_err(|e| connect_error(&config, e))?;
        let streams: Vec<String> = config
            .topics
            .iter()
            .map(|t| format!("{}{t}", config.key_prefix))
            .collect();
        if config.create_group {
            for s in &streams {
                let mut c = ops.clone();
                let r: Result<Value, _> = redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(s)
                    .arg(&config.group)
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async(&mut c)
                    .await;
                match r {
                    Ok(_) => {}
                    Err(e) if e.code() == Some("BUSYGROUP") => {}
                    Err(e) => {
                        return Err(connect_error(&config, format!("XGROUP CREATE {s}: {e}")));
                    }
                }
            }
        }
        let state = State {
            own_cursor: streams
                .iter()
                .map(|s| (s.clone(), Some("0".to_owned())))
                .collect(),
            ..State::default()
        };
        Ok(Self {
            inner: Arc::new(Inner {
                ops,
                reader: tokio::sync::Mutex::new(reader),
                config,
                streams,
                state: Mutex::new(state),
                buffer: Mutex::default(),
                reading: tokio::sync::Mutex::new(()),
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The stream keys read.
    pub fn streams(&self) -> &[String] {
        &self.inner.streams
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().expect("poisoned")
    }

    /// Builds deliveries for entries of `stream` answered at `at`, with their counts read by one
    /// XPENDING (R136).
    async fn deliveries(
        &self,
        stream: &str,
        entries: Vec<Entry>,
        at: Instant,
        touches: &HashMap<String, Arc<Touch>>,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let counts = self.counts(stream, &entries).await?;
        Ok(entries
            .into_iter()
            .map(|e| {
                let n = counts.get(&e.id).copied().unwrap_or(1).max(1);
                let touch = touches
                    .get(&e.id)
                    .cloned()
                    .unwrap_or_else(|| Touch::new(at));
                touch.set(at);
                touch.lost.store(false, Ordering::SeqCst);
                InboxDelivery {
                    message: BrokerMessage::Redis {
                        stream_key: stream.to_owned(),
                        key_prefix: self.inner.config.key_prefix.clone(),
                        entry_id: e.id.clone(),
                        fields: e.fields.clone(),
                    },
                    delivery_number: u32::try_from(n).unwrap_or(u32::MAX),
                    redelivered_later: true,
                    ack: Arc::new(RedisAck {
                        inner: self.inner.clone(),
                        stream: stream.to_owned(),
                        id: e.id,
                        fields: e.fields,
                        touch,
                    }),
                }
            })
            .collect())
    }

    async fn counts(
        &self,
        stream: &str,
        entries: &[Entry],
    ) -> Result<HashMap<String, i64>, SubscriptionError> {
        let min = entries.iter().map(|e| IdOrd(&e.id)).min().map(|i| i.0);
        let max = entries.iter().map(|e| IdOrd(&e.id)).max().map(|i| i.0);
        let (Some(min), Some(max)) = (min, max) else {
            return Ok(HashMap::new());
        };
        let mut c = self.inner.ops.clone();
        let v: Value = redis::cmd("XPENDING")
            .arg(stream)
            .arg(&self.inner.config.group)
            .arg(min)
            .arg(max)
            .arg(entries.len().max(1) * 4 + 16)
            .query_async(&mut c)
            .await
            .map_err(|e| err("XPENDING", e))?;
        let mut out = HashMap::new();
        for row in array(v) {
            let r = array(row);
            if r.len() >= 4 {
                out.insert(string(&r[0]), int(&r[3]));
            }
        }
        Ok(out)
    }

    /// XCLAIM of `ids` to this consumer with `min_idle`; JUSTID returns ids only.
    async fn xclaim(
        &self,
        stream: &str,
        ids: &[&str],
        min_idle: Duration,
        justid: bool,
    ) -> Result<Value, SubscriptionError> {
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(stream)
            .arg(&self.inner.config.group)
            .arg(&self.inner.config.consumer)
            .arg(min_idle.as_millis() as u64);
        for id in ids {
            cmd.arg(*id);
        }
        if justid {
            cmd.arg("JUSTID");
        }
        let mut c = self.inner.ops.clone();
        cmd.query_async(&mut c).await.map_err(|e| err("XCLAIM", e))
    }

    /// Renews `touch`'s entry (R136): XCLAIM JUSTID with min-idle = the time since the last
    /// answer. Marks it lost when another consumer has claimed it since.
    async fn renew_entry(
        &self,
        stream: &str,
        id: &str,
        touch: &Touch,
    ) -> Result<(), SubscriptionError> {
        if touch.lost.load(Ordering::SeqCst) {
            return Ok(());
        }
        let idle = touch.since();
        let v = self.xclaim(stream, &[id], idle, true).await?;
        let at = Instant::now();
        if array(v).iter().any(|x| string(x) == id) {
            touch.set(at);
        } else {
            touch.lost.store(true, Ordering::SeqCst);
            tracing::debug!(stream, id, "a held Redis entry passed to another consumer");
        }
        Ok(())
    }

    /// Rewinds whose delay has passed are claimed again (XCLAIM counts a delivery); the others
    /// are renewed when due.
    async fn due_rewinds(&self, max: usize) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        let now = Instant::now();
        let half = self.inner.config.claim_idle / 2;
        let (due, renew): (Vec<Rewind>, Vec<Renewal>) = {
            let mut st = self.lock();
            st.rewinds.sort_by_key(|r| r.due);
            let n = st
                .rewinds
                .iter()
                .take_while(|r| r.due <= now)
                .count()
                .min(max);
            let due: Vec<Rewind> = st.rewinds.drain(..n).collect();
            let renew = st
                .rewinds
                .iter()
                .filter(|r| r.touch.since() >= half)
                .map(|r| (r.stream.clone(), r.id.clone(), r.touch.clone()))
                .collect();
            (due, renew)
        };
        for (s, id, t) in renew {
            self.renew_entry(&s, &id, &t).await?;
        }
        let mut out = Vec::new();
        for r in due {
            if r.touch.lost.load(Ordering::SeqCst) {
                continue;
            }
            let idle = r.touch.since();
            let v = self.xclaim(&r.stream, &[&r.id], idle, false).await?;
            let at = Instant::now();
            let entries = entries_of(v);
            if entries.is_empty() {
                // Claimed by another consumer, or trimmed.
                continue;
            }
            let touches = HashMap::from([(r.id.clone(), r.touch.clone())]);
            out.extend(self.deliveries(&r.stream, entries, at, &touches).await?);
        }
        Ok(out)
    }

    /// Every claim_idle / 2: XAUTOCLAIM of entries idle for claim_idle (R136).
    async fn autoclaim(&self, max: usize) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        let half = self.inner.config.claim_idle / 2;
        {
            let mut st = self.lock();
            if st.last_autoclaim.is_some_and(|t| t.elapsed() < half) {
                return Ok(Vec::new());
            }
            st.last_autoclaim = Some(Instant::now());
        }
        let mut out = Vec::new();
        for s in self.inner.streams.clone() {
            if out.len() >= max {
                break;
            }
            let mut c = self.inner.ops.clone();
            let v: Value = redis::cmd("XAUTOCLAIM")
                .arg(&s)
                .arg(&self.inner.config.group)
                .arg(&self.inner.config.consumer)
                .arg(self.inner.config.claim_idle.as_millis() as u64)
                .arg("0")
                .arg("COUNT")
                .arg(max - out.len())
                .query_async(&mut c)
                .await
                .map_err(|e| err("XAUTOCLAIM", e))?;
            let at = Instant::now();
            let parts = array(v);
            let entries = parts.get(1).cloned().map(entries_of).unwrap_or_default();
            out.extend(self.deliveries(&s, entries, at, &HashMap::new()).await?);
        }
        Ok(out)
    }

    /// The own-pending phase (id `0` onwards), then `>` with BLOCK.
    async fn read(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        let own: Vec<(String, String)> = self
            .lock()
            .own_cursor
            .iter()
            .filter_map(|(s, c)| c.clone().map(|c| (s.clone(), c)))
            .collect();
        let mut out = Vec::new();
        for (s, cursor) in own {
            let mut c = self.inner.ops.clone();
            let v: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&self.inner.config.group)
                .arg(&self.inner.config.consumer)
                .arg("COUNT")
                .arg(max)
                .arg("STREAMS")
                .arg(&s)
                .arg(&cursor)
                .query_async(&mut c)
                .await
                .map_err(|e| err("XREADGROUP (own pending)", e))?;
            let at = Instant::now();
            let mut entries: Vec<Entry> = streams_of(v).into_iter().flat_map(|(_, e)| e).collect();
            let next = entries.last().map(|e| e.id.clone());
            self.lock().own_cursor.insert(s.clone(), next.clone());
            // An entry deleted from the stream while pending comes back without fields: ack it.
            let gone: Vec<String> = entries
                .iter()
                .filter(|e| e.deleted)
                .map(|e| e.id.clone())
                .collect();
            entries.retain(|e| !e.deleted);
            for id in gone {
                let mut c = self.inner.ops.clone();
                let _: Result<Value, _> = redis::cmd("XACK")
                    .arg(&s)
                    .arg(&self.inner.config.group)
                    .arg(&id)
                    .query_async(&mut c)
                    .await;
            }
            out.extend(self.deliveries(&s, entries, at, &HashMap::new()).await?);
            if !out.is_empty() {
                return Ok(out);
            }
        }
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.inner.config.group)
            .arg(&self.inner.config.consumer)
            .arg("COUNT")
            .arg(max);
        let block = wait.min(self.inner.config.block_time());
        if !block.is_zero() {
            cmd.arg("BLOCK").arg(block.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS");
        for s in &self.inner.streams {
            cmd.arg(s);
        }
        for _ in &self.inner.streams {
            cmd.arg(">");
        }
        let v: Value = {
            let mut reader = self.inner.reader.lock().await;
            cmd.query_async(&mut *reader)
                .await
                .map_err(|e| err("XREADGROUP", e))?
        };
        let at = Instant::now();
        for (s, entries) in streams_of(v) {
            out.extend(self.deliveries(&s, entries, at, &HashMap::new()).await?);
        }
        Ok(out)
    }
}

impl RedisSubscription {
    async fn next_inner(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        let mut out = self.due_rewinds(max).await?;
        if out.len() < max {
            let more = self.autoclaim(max - out.len()).await?;
            out.extend(more);
        }
        if out.is_empty() {
            // Wait no longer than the next rewind is due.
            let next_due = self.lock().rewinds.iter().map(|r| r.due).min();
            let wait = match next_due {
                Some(t) => wait.min(t.saturating_duration_since(Instant::now())),
                None => wait,
            };
            out = self.read(max, wait).await?;
        }
        Ok(out)
    }
}

#[async_trait]
impl Subscription for RedisSubscription {
    fn capabilities(&self) -> SubscriptionCapabilities {
        SubscriptionCapabilities {
            name: "redis",
            rewind: true,
            last_delivery: false,
            renew_every: Some(self.inner.config.claim_idle / 2),
        }
    }

    /// The config's consumer group: the runner's (`Runner::for_subscription` takes it).
    fn group(&self) -> Option<&str> {
        Some(&self.inner.config.group)
    }

    /// The config's topics (the streams are the key prefix + topic): the runner's default
    /// sources (R121).
    fn topics(&self) -> Option<&[String]> {
        Some(&self.inner.config.topics)
    }

    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        if max == 0 || self.inner.closed.load(Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        if self.inner.buffer.lock().expect("poisoned").is_empty() {
            // The read runs in a task of its own, so that a read the runner gives up on does
            // not leave entries pending under this consumer unhandled until claim_idle.
            let me = self.clone();
            tokio::spawn(async move {
                let _reading = me.inner.reading.lock().await;
                if me.inner.closed.load(Ordering::SeqCst) {
                    return Ok(());
                }
                let got = me.next_inner(max, wait).await?;
                me.inner.buffer.lock().expect("poisoned").extend(got);
                Ok::<(), SubscriptionError>(())
            })
            .await
            .map_err(|e| err("a read task", e))??;
        }
        let mut b = self.inner.buffer.lock().expect("poisoned");
        let n = b.len().min(max);
        Ok(b.drain(..n).collect())
    }

    /// Deletes the consumer from the group when it has no pending entry (R135, R167).
    async fn close(&self) {
        // No read after this one; wait for one in flight (at most its BLOCK time), whose
        // entries then stay pending under this consumer, which is then kept.
        self.inner.closed.store(true, Ordering::SeqCst);
        drop(self.inner.reading.lock().await);
        let cfg = &self.inner.config;
        let mut c = self.inner.ops.clone();
        for s in &self.inner.streams {
            let v: Result<Value, _> = redis::cmd("XPENDING")
                .arg(s)
                .arg(&cfg.group)
                .arg("-")
                .arg("+")
                .arg(1)
                .arg(&cfg.consumer)
                .query_async(&mut c)
                .await;
            match v {
                Ok(v) if array(v.clone()).is_empty() => {}
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "XPENDING at the clean stop failed; the consumer is kept");
                    return;
                }
            }
        }
        for s in &self.inner.streams {
            let r: Result<Value, _> = redis::cmd("XGROUP")
                .arg("DELCONSUMER")
                .arg(s)
                .arg(&cfg.group)
                .arg(&cfg.consumer)
                .query_async(&mut c)
                .await;
            if let Err(e) = r {
                tracing::warn!(error = %e, stream = %s, "XGROUP DELCONSUMER failed");
            }
        }
    }
}

struct RedisAck {
    inner: Arc<Inner>,
    stream: String,
    id: String,
    fields: Vec<(String, String)>,
    touch: Arc<Touch>,
}

impl RedisAck {
    fn sub(&self) -> RedisSubscription {
        RedisSubscription {
            inner: self.inner.clone(),
        }
    }

    async fn xack(&self) -> Result<(), SubscriptionError> {
        let mut c = self.inner.ops.clone();
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.inner.config.group)
            .arg(&self.id)
            .query_async(&mut c)
            .await
            .map_err(|e| err("XACK", e))?;
        Ok(())
    }
}

#[async_trait]
impl AckHandle for RedisAck {
    /// XACK; 0 (no longer pending) counts as committed (R136).
    async fn commit(&self) -> Result<(), SubscriptionError> {
        self.xack().await
    }

    /// Keeps the entry pending under this consumer, renewed, and claims it again after `delay`;
    /// with `max_waiting_rewinds` already waiting, leaves it pending without a timer or
    /// renewals, so that XAUTOCLAIM brings it back after claim_idle (R136).
    async fn rewind(&self, delay: Duration) -> Result<(), SubscriptionError> {
        let mut st = self.inner.state.lock().expect("poisoned");
        if st.rewinds.len() < self.inner.config.max_waiting_rewinds {
            st.rewinds.push(Rewind {
                stream: self.stream.clone(),
                id: self.id.clone(),
                due: Instant::now() + delay,
                touch: self.touch.clone(),
            });
        }
        Ok(())
    }

    /// False once `max_waiting_rewinds` rewinds wait (R136).
    fn rewind_has_room(&self) -> bool {
        self.inner.state.lock().expect("poisoned").rewinds.len()
            < self.inner.config.max_waiting_rewinds
    }

    /// XACK (after the copy of R140).
    async fn term(&self, _reason: &str) -> Result<(), SubscriptionError> {
        self.xack().await
    }

    /// XCLAIM JUSTID to itself (R136).
    async fn renew(&self) -> Result<(), SubscriptionError> {
        self.sub()
            .renew_entry(&self.stream, &self.id, &self.touch)
            .await
    }

    /// XADD to `{stream}:dead-letter` and XACK in one MULTI/EXEC (R140).
    async fn dead_letter(&self, reason: &str, group: &str) -> Result<(), SubscriptionError> {
        let dl = format!("{}{}", self.stream, self.inner.config.dead_letter_suffix);
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&dl).arg("*");
        for (k, v) in &self.fields {
            xadd.arg(k).arg(v);
        }
        xadd.arg("invalid_reason")
            .arg(reason)
            .arg("consumer_group")
            .arg(group)
            .arg("original_stream")
            .arg(&self.stream)
            .arg("original_id")
            .arg(&self.id);
        let mut p = redis::pipe();
        p.atomic()
            .add_command(xadd)
            .ignore()
            .cmd("XACK")
            .arg(&self.stream)
            .arg(&self.inner.config.group)
            .arg(&self.id)
            .ignore();
        let mut c = self.inner.ops.clone();
        let _: () = p
            .query_async(&mut c)
            .await
            .map_err(|e| err(&format!("the dead-letter copy to {dl}"), e))?;
        Ok(())
    }
}

/// One stream entry as read.
struct Entry {
    id: String,
    fields: Vec<(String, String)>,
    deleted: bool,
}

/// Orders entry ids `ms-seq` numerically.
#[derive(PartialEq, Eq)]
struct IdOrd<'a>(&'a str);

impl IdOrd<'_> {
    fn parts(&self) -> (u64, u64) {
        let mut it = self.0.splitn(2, '-');
        let a = it.next().and_then(|x| x.parse().ok()).unwrap_or(0);
        let b = it.next().and_then(|x| x.parse().ok()).unwrap_or(0);
        (a, b)
    }
}

impl PartialOrd for IdOrd<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for IdOrd<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.parts().cmp(&other.parts())
    }
}

fn array(v: Value) -> Vec<Value> {
    match v {
        Value::Array(a) | Value::Set(a) => a,
        Value::Map(m) => m.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => Vec::new(),
    }
}

fn string(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        other => string(other).parse().unwrap_or(0),
    }
}

/// Entries `[[id, [k, v, …]], …]`; an entry without fields was deleted from the stream.
fn entries_of(v: Value) -> Vec<Entry> {
    array(v)
        .into_iter()
        .filter_map(|e| {
            let mut parts = array(e).into_iter();
            let id = string(&parts.next()?);
            let fv = parts.next().unwrap_or(Value::Nil);
            let deleted = matches!(fv, Value::Nil);
            let flat = array(fv);
            let fields = flat
                .chunks(2)
                .filter(|c| c.len() == 2)
                .map(|c| (string(&c[0]), string(&c[1])))
                .collect();
            Some(Entry {
                id,
                fields,
                deleted,
            })
        })
        .collect()
}

/// An XREADGROUP reply: `[[key, entries], …]` (RESP2) or a map (RESP3); nil on timeout.
fn streams_of(v: Value) -> Vec<(String, Vec<Entry>)> {
    match v {
        Value::Map(m) => m
            .into_iter()
            .map(|(k, v)| (string(&k), entries_of(v)))
            .collect(),
        other => array(other)
            .into_iter()
            .filter_map(|s| {
                let mut p = array(s).into_iter();
                let k = string(&p.next()?);
                Some((k, p.next().map(entries_of).unwrap_or_default()))
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_order_numerically() {
        assert!(IdOrd("10-0") > IdOrd("9-5"));
        assert!(IdOrd("9-10") > IdOrd("9-9"));
    }

    #[test]
    fn settings_are_checked() {
        let c = RedisSubscriptionConfig::new("redis://127.0.0.1:6379", "g", "w1", ["src"]);
        assert!(c.validate().is_ok());
        assert!(
            c.clone()
                .claim_idle(Duration::from_millis(500))
                .validate()
                .is_err()
        );
        assert!(c.clone().block(Duration::from_secs(30)).validate().is_err());
        assert!(c.clone().max_waiting_rewinds(0).validate().is_err());
        assert!(c.clone().max_waiting_rewinds(1).validate().is_ok());
        assert!(
            RedisSubscriptionConfig::new("redis://x", "g", "w1", Vec::<String>::new())
                .validate()
                .is_err()
        );
    }
}
