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
use txoutbox_core::inbox::subscription::{SubscriptionCapabilities, SubscriptionError};
use txoutbox_core::inbox::transport::{
    DeadLetter, Received, Transport, TransportCapabilities, TransportSubscription, transient,
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
    max_waiting_rewinds: Option<usize>,
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
            max_waiting_rewinds: None,
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

    /// How many rewinds may wait at once (R136; ≥ 1). Optional: by default the bound is the
    /// runner's concurrency, which the runner gives the subscription when it is built; set
    /// this only to bound the rewinds otherwise. Beyond it, a handler failure the rewind
    /// policy would rewind is recorded in the row instead, and a rewind after a persistence error
    /// or a failed dead-letter copy (R132, R140) is left pending without a timer: it comes back
    /// through XAUTOCLAIM after claim_idle. This bounds what a long database outage can pile up.
    pub fn max_waiting_rewinds(mut self, n: usize) -> Self {
        self.max_waiting_rewinds = Some(n);
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
        if self.max_waiting_rewinds == Some(0) {
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

/// Per stream, the cursor of the own-pending phase (none once it is over), and when the last
/// XAUTOCLAIM ran.
#[derive(Default)]
struct State {
    own_cursor: HashMap<String, Option<String>>,
    last_autoclaim: Option<Instant>,
}

/// The Redis half of the inbox's subscription ([`Transport`]): one consumer of a group on
/// the streams prefix + topic. Reached through [`RedisSubscription`].
pub struct RedisTransport {
    ops: ConnectionManager,
    reader: tokio::sync::Mutex<ConnectionManager>,
    config: RedisSubscriptionConfig,
    streams: Vec<String>,
    state: Mutex<State>,
}

/// One entry as read: where it is, its fields, its delivery count, and when this runner last
/// had an answer about it (R136).
pub struct RedisEntry {
    stream: String,
    id: String,
    fields: Vec<(String, String)>,
    n: u32,
    touch: Arc<Touch>,
}

txoutbox_core::transport_subscription! {
    /// The inbox's subscription on a Redis Streams consumer group (R135, R136): the generic
    /// subscription over [`RedisTransport`], whose waiting rewinds it bounds. Cloning shares it.
    pub struct RedisSubscription(RedisTransport);
}

fn connect_error(config: &RedisSubscriptionConfig, e: impl std::fmt::Display) -> RedisBrokerError {
    RedisBrokerError::Connect {
        url: txoutbox_core::redact::secrets(&config.url),
        message: txoutbox_core::redact::secrets(&e.to_string()),
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> SubscriptionError {
    transient("Redis", what, e)
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
        let bound = config.max_waiting_rewinds;
        let sub = TransportSubscription::new(RedisTransport {
            ops,
            reader: tokio::sync::Mutex::new(reader),
            config,
            streams,
            state: Mutex::new(state),
        });
        Ok(Self(match bound {
            Some(n) => sub.with_rewind_bound(n),
            None => sub,
        }))
    }

    /// The stream keys read.
    pub fn streams(&self) -> &[String] {
        &self.transport().streams
    }
}

impl RedisTransport {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("poisoned")
    }

    /// Entries of `stream` answered at `at`, with their counts read by one XPENDING (R136).
    async fn entries(
        &self,
        stream: &str,
        entries: Vec<Entry>,
        at: Instant,
        touches: &HashMap<String, Arc<Touch>>,
    ) -> Result<Vec<RedisEntry>, SubscriptionError> {
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
                RedisEntry {
                    stream: stream.to_owned(),
                    id: e.id,
                    fields: e.fields,
                    n: u32::try_from(n).unwrap_or(u32::MAX),
                    touch,
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
        let mut c = self.ops.clone();
        let v: Value = redis::cmd("XPENDING")
            .arg(stream)
            .arg(&self.config.group)
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
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg(min_idle.as_millis() as u64);
        for id in ids {
            cmd.arg(*id);
        }
        if justid {
            cmd.arg("JUSTID");
        }
        let mut c = self.ops.clone();
        cmd.query_async(&mut c).await.map_err(|e| err("XCLAIM", e))
    }

    async fn xack(&self, m: &RedisEntry) -> Result<(), SubscriptionError> {
        let mut c = self.ops.clone();
        let _: i64 = redis::cmd("XACK")
            .arg(&m.stream)
            .arg(&self.config.group)
            .arg(&m.id)
            .query_async(&mut c)
            .await
            .map_err(|e| err("XACK", e))?;
        Ok(())
    }

    /// Every claim_idle / 2: XAUTOCLAIM of entries idle for claim_idle (R136).
    async fn autoclaim(&self, max: usize) -> Result<Vec<RedisEntry>, SubscriptionError> {
        let half = self.config.claim_idle / 2;
        {
            let mut st = self.lock();
            if st.last_autoclaim.is_some_and(|t| t.elapsed() < half) {
                return Ok(Vec::new());
            }
            st.last_autoclaim = Some(Instant::now());
        }
        let mut out = Vec::new();
        for s in &self.streams {
            if out.len() >= max {
                break;
            }
            let mut c = self.ops.clone();
            let v: Value = redis::cmd("XAUTOCLAIM")
                .arg(s)
                .arg(&self.config.group)
                .arg(&self.config.consumer)
                .arg(self.config.claim_idle.as_millis() as u64)
                .arg("0")
                .arg("COUNT")
                .arg(max - out.len())
                .query_async(&mut c)
                .await
                .map_err(|e| err("XAUTOCLAIM", e))?;
            let at = Instant::now();
            let parts = array(v);
            let entries = parts.get(1).cloned().map(entries_of).unwrap_or_default();
            out.extend(self.entries(s, entries, at, &HashMap::new()).await?);
        }
        Ok(out)
    }

    /// The own-pending phase (id `0` onwards), then `>` with BLOCK.
    async fn read_group(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<RedisEntry>, SubscriptionError> {
        let own: Vec<(String, String)> = self
            .lock()
            .own_cursor
            .iter()
            .filter_map(|(s, c)| c.clone().map(|c| (s.clone(), c)))
            .collect();
        let mut out = Vec::new();
        for (s, cursor) in own {
            let mut c = self.ops.clone();
            let v: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&self.config.group)
                .arg(&self.config.consumer)
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
                let mut c = self.ops.clone();
                let _: Result<Value, _> = redis::cmd("XACK")
                    .arg(&s)
                    .arg(&self.config.group)
                    .arg(&id)
                    .query_async(&mut c)
                    .await;
            }
            out.extend(self.entries(&s, entries, at, &HashMap::new()).await?);
            if !out.is_empty() {
                return Ok(out);
            }
        }
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg("COUNT")
            .arg(max);
        let block = wait.min(self.config.block_time());
        if !block.is_zero() {
            cmd.arg("BLOCK").arg(block.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS");
        for s in &self.streams {
            cmd.arg(s);
        }
        for _ in &self.streams {
            cmd.arg(">");
        }
        let v: Value = {
            let mut reader = self.reader.lock().await;
            cmd.query_async(&mut *reader)
                .await
                .map_err(|e| err("XREADGROUP", e))?
        };
        let at = Instant::now();
        for (s, entries) in streams_of(v) {
            out.extend(self.entries(&s, entries, at, &HashMap::new()).await?);
        }
        Ok(out)
    }
}

#[async_trait]
impl Transport for RedisTransport {
    type Message = RedisEntry;

    /// A rewind keeps the entry pending under this consumer, renewed, and claims it again when
    /// due: it waits in the process, bounded by the runner's concurrency (R136).
    fn capabilities(&self) -> TransportCapabilities {
        TransportCapabilities {
            subscription: SubscriptionCapabilities {
                name: "redis",
                rewind: true,
                last_delivery: false,
                renew_every: Some(self.config.claim_idle / 2),
                rewind_refusal: None,
            },
            holds_rewinds: true,
            longest_hold: None,
        }
    }

    /// The config's consumer group: the runner's (`Runner::for_subscription` takes it).
    fn group(&self) -> Option<&str> {
        Some(&self.config.group)
    }

    /// The config's topics (the streams are the key prefix + topic): the runner's default
    /// sources (R121).
    fn topics(&self) -> Option<&[String]> {
        Some(&self.config.topics)
    }

    /// Entries idle for claim_idle (XAUTOCLAIM, every claim_idle / 2) first; else this
    /// consumer's own pending entries, then new ones with BLOCK (R135, R136).
    async fn read(&self, max: usize, wait: Duration) -> Result<Vec<RedisEntry>, SubscriptionError> {
        let claimed = self.autoclaim(max).await?;
        if !claimed.is_empty() {
            return Ok(claimed);
        }
        self.read_group(max, wait).await
    }

    /// n is the entry's count in the pending entries list; Redis has no last delivery.
    fn received(&self, m: &RedisEntry) -> Result<Received, SubscriptionError> {
        Ok(Received {
            message: BrokerMessage::Redis {
                stream_key: m.stream.clone(),
                key_prefix: self.config.key_prefix.clone(),
                entry_id: m.id.clone(),
                fields: m.fields.clone(),
            },
            delivery_number: m.n,
            redelivered_later: true,
        })
    }

    /// XACK; 0 (no longer pending) counts as committed (R136).
    async fn commit(&self, m: &RedisEntry) -> Result<(), SubscriptionError> {
        self.xack(m).await
    }

    /// A rewind that does not wait in the process (beyond the bound, or still waiting at
    /// close): the entry is left pending without a timer or renewals, and XAUTOCLAIM brings it
    /// back after claim_idle (R136).
    async fn rewind(&self, _m: &RedisEntry, _delay: Duration) -> Result<(), SubscriptionError> {
        Ok(())
    }

    /// The delay has passed: XCLAIM, which counts a delivery; nothing when the entry passed to
    /// another consumer or was trimmed (R136).
    async fn take_back(
        &self,
        m: &RedisEntry,
        _delay: Duration,
    ) -> Result<Vec<RedisEntry>, SubscriptionError> {
        if m.touch.lost.load(Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        let v = self
            .xclaim(&m.stream, &[&m.id], m.touch.since(), false)
            .await?;
        let at = Instant::now();
        let touches = HashMap::from([(m.id.clone(), m.touch.clone())]);
        self.entries(&m.stream, entries_of(v), at, &touches).await
    }

    /// XACK (after the copy of R140).
    async fn term(&self, m: &RedisEntry, _reason: &str) -> Result<(), SubscriptionError> {
        self.xack(m).await
    }

    /// XCLAIM JUSTID to itself with min-idle = the time since the last answer about the entry
    /// (R136); an entry it does not return has passed to another consumer and is not renewed
    /// again.
    async fn renew(&self, m: &RedisEntry) -> Result<(), SubscriptionError> {
        if m.touch.lost.load(Ordering::SeqCst) {
            return Ok(());
        }
        let v = self
            .xclaim(&m.stream, &[&m.id], m.touch.since(), true)
            .await?;
        let at = Instant::now();
        if array(v).iter().any(|x| string(x) == m.id) {
            m.touch.set(at);
        } else {
            m.touch.lost.store(true, Ordering::SeqCst);
            tracing::debug!(stream = %m.stream, id = %m.id, "a held Redis entry passed to another consumer");
        }
        Ok(())
    }

    /// XADD to `{stream}:dead-letter` with the fields and R140's, and XACK, in one MULTI/EXEC.
    async fn dead_letter(
        &self,
        m: &RedisEntry,
        letter: &DeadLetter<'_>,
    ) -> Result<(), SubscriptionError> {
        let dl = format!("{}{}", m.stream, self.config.dead_letter_suffix);
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&dl).arg("*");
        let added = letter.fields(&[("Stream", m.stream.clone()), ("Id", m.id.clone())]);
        for (k, v) in m.fields.iter().chain(&added) {
            xadd.arg(k).arg(v);
        }
        let mut p = redis::pipe();
        p.atomic()
            .add_command(xadd)
            .ignore()
            .cmd("XACK")
            .arg(&m.stream)
            .arg(&self.config.group)
            .arg(&m.id)
            .ignore();
        let mut c = self.ops.clone();
        let _: () = p
            .query_async(&mut c)
            .await
            .map_err(|e| err(&format!("the dead-letter copy to {dl}"), e))?;
        Ok(())
    }

    /// Deletes the consumer from the group when it has no pending entry (R135, R167); entries
    /// read ahead or rewound stay pending under it, which is then kept.
    async fn close(&self) {
        let cfg = &self.config;
        let mut c = self.ops.clone();
        for s in &self.streams {
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
        for s in &self.streams {
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
