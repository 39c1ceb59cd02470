//! A fifth broker, in process, written on `txoutbox_core::inbox::transport` from outside
//! outbox-core: it shows that a broker adapter needs no edit to outbox-core, and it runs the
//! broker-independent J and G trials ([`crate::inbox_broker_suite!`]) in
//! `conformance/tests/inbox_channel.rs`, with R136's bound (J-38) checked on it.
//!
//! [`ChannelBroker`] keeps a log of published messages and, per consumer group, a cursor, the
//! messages handed out and not ended (each back to the group when its ack deadline passes,
//! like a NATS ack_wait or a Redis claim_idle), the rewinds due later and a count of deliveries
//! per message. [`ChannelTransport`] is one consumer of one group:
//!
//! | operation | channel broker |
//! |---|---|
//! | read | rewinds due, then messages whose deadline passed, then new ones; waits for a publish or a due time up to `wait` |
//! | commit, term | the message is done for the group |
//! | rewind(d) | back to the group after d |
//! | renew | the deadline moves to now + ack_wait |
//! | dead-letter copy | the message and R140's headers in the broker's dead-letter list |
//!
//! Its rewinds wait in the process ([`TransportCapabilities::holds_rewinds`]), so the generic
//! subscription bounds them (R136); n is the broker's count; it has no last delivery. Its
//! messages reach decoding in the NATS shape (headers and a body, `chan:{seq}` as position),
//! since outbox-core's decoding still reads one of four broker shapes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;
use txoutbox_core::inbox::decode::BrokerMessage;
use txoutbox_core::inbox::subscription::{SubscriptionCapabilities, SubscriptionError};
use txoutbox_core::inbox::transport::{
    DeadLetter, Received, Transport, TransportCapabilities, TransportSubscription,
};

/// One published message.
#[derive(Debug, Clone)]
struct Stored {
    seq: u64,
    topic: String,
    attrs: Vec<(String, String)>,
    body: String,
}

#[derive(Default)]
struct Group {
    cursor: usize,
    /// Handed out and not ended: seq → deadline.
    pending: HashMap<u64, Instant>,
    /// Rewound: seq → when it is due.
    rewound: HashMap<u64, Instant>,
    delivered: HashMap<u64, u32>,
    done: HashSet<u64>,
}

#[derive(Default)]
struct State {
    log: Vec<Stored>,
    groups: HashMap<String, Group>,
    dead_letters: Vec<(u64, Vec<(String, String)>)>,
}

/// An in-process broker (see the module docs). Cloning shares it.
#[derive(Clone, Default)]
pub struct ChannelBroker {
    state: Arc<Mutex<State>>,
    published: Arc<Notify>,
}

impl ChannelBroker {
    /// Publishes one message on `topic`.
    pub fn publish(&self, topic: &str, attrs: &[(&str, &str)], body: &str) {
        let mut st = self.state.lock().expect("poisoned");
        let seq = st.log.len() as u64 + 1;
        st.log.push(Stored {
            seq,
            topic: topic.to_owned(),
            attrs: attrs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.to_owned(),
        });
        drop(st);
        self.published.notify_waiters();
    }

    /// The dead-letter list: each copied message's sequence and the headers R140 added.
    pub fn dead_letters(&self) -> Vec<(u64, Vec<(String, String)>)> {
        self.state.lock().expect("poisoned").dead_letters.clone()
    }

    /// How many messages of `group` were handed out and not ended, rewinds included.
    pub fn unended(&self, group: &str) -> usize {
        let st = self.state.lock().expect("poisoned");
        st.groups
            .get(group)
            .map_or(0, |g| g.pending.len() + g.rewound.len())
    }

    /// A subscription of `group` on `topics` whose unended deliveries come back after
    /// `ack_wait`.
    pub fn subscription(
        &self,
        group: &str,
        topics: &[&str],
        ack_wait: Duration,
    ) -> TransportSubscription<ChannelTransport> {
        TransportSubscription::new(ChannelTransport {
            broker: self.clone(),
            group: group.to_owned(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            ack_wait,
        })
    }

    /// Takes up to `max` ready messages of `group` at `now`.
    fn take(
        &self,
        group: &str,
        topics: &[String],
        ack_wait: Duration,
        max: usize,
    ) -> Vec<ChannelMessage> {
        let now = Instant::now();
        let mut st = self.state.lock().expect("poisoned");
        let State { log, groups, .. } = &mut *st;
        let g = groups.entry(group.to_owned()).or_default();
        let mut ready: Vec<u64> = g
            .rewound
            .iter()
            .filter(|(_, due)| **due <= now)
            .map(|(s, _)| *s)
            .collect();
        ready.sort_unstable();
        let mut expired: Vec<u64> = g
            .pending
            .iter()
            .filter(|(_, dl)| **dl <= now)
            .map(|(s, _)| *s)
            .collect();
        expired.sort_unstable();
        ready.extend(expired);
        while ready.len() < max && g.cursor < log.len() {
            let m = &log[g.cursor];
            g.cursor += 1;
            if topics.contains(&m.topic) {
                ready.push(m.seq);
            }
        }
        ready.truncate(max);
        ready
            .into_iter()
            .map(|seq| {
                g.rewound.remove(&seq);
                g.pending.insert(seq, now + ack_wait);
                let n = g.delivered.entry(seq).or_insert(0);
                *n += 1;
                ChannelMessage {
                    stored: log[seq as usize - 1].clone(),
                    n: *n,
                }
            })
            .collect()
    }

    /// The next time something of `group` falls due.
    fn next_due(&self, group: &str) -> Option<Instant> {
        let st = self.state.lock().expect("poisoned");
        let g = st.groups.get(group)?;
        g.rewound.values().chain(g.pending.values()).min().copied()
    }

    fn with_group<R>(&self, group: &str, f: impl FnOnce(&mut Group) -> R) -> R {
        let mut st = self.state.lock().expect("poisoned");
        f(st.groups.entry(group.to_owned()).or_default())
    }

    fn end(&self, group: &str, seq: u64) {
        self.with_group(group, |g| {
            g.pending.remove(&seq);
            g.rewound.remove(&seq);
            g.done.insert(seq);
        });
    }
}

/// One message as read.
pub struct ChannelMessage {
    stored: Stored,
    n: u32,
}

/// One consumer of one group on a [`ChannelBroker`].
pub struct ChannelTransport {
    broker: ChannelBroker,
    group: String,
    topics: Vec<String>,
    ack_wait: Duration,
}

#[async_trait]
impl Transport for ChannelTransport {
    type Message = ChannelMessage;

    fn capabilities(&self) -> TransportCapabilities {
        TransportCapabilities {
            subscription: SubscriptionCapabilities {
                name: "channel",
                rewind: true,
                last_delivery: false,
                renew_every: Some(self.ack_wait / 2),
                rewind_refusal: None,
            },
            holds_rewinds: true,
            longest_hold: None,
        }
    }

    fn group(&self) -> Option<&str> {
        Some(&self.group)
    }

    fn topics(&self) -> Option<&[String]> {
        Some(&self.topics)
    }

    async fn read(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<ChannelMessage>, SubscriptionError> {
        let until = Instant::now() + wait;
        loop {
            let published = self.broker.published.notified();
            let got = self
                .broker
                .take(&self.group, &self.topics, self.ack_wait, max);
            let now = Instant::now();
            if !got.is_empty() || now >= until {
                return Ok(got);
            }
            let wake = self
                .broker
                .next_due(&self.group)
                .map_or(until, |d| d.min(until))
                .max(now + Duration::from_millis(1));
            let _ = tokio::time::timeout_at(wake, published).await;
        }
    }

    fn received(&self, m: &ChannelMessage) -> Result<Received, SubscriptionError> {
        Ok(Received {
            message: BrokerMessage::Nats {
                stream: "chan".into(),
                sequence: m.stored.seq,
                subject: m.stored.topic.clone(),
                subject_prefix: String::new(),
                headers: m.stored.attrs.clone(),
                body: m.stored.body.clone().into_bytes(),
            },
            delivery_number: m.n,
            redelivered_later: true,
        })
    }

    async fn commit(&self, m: &ChannelMessage) -> Result<(), SubscriptionError> {
        self.broker.end(&self.group, m.stored.seq);
        Ok(())
    }

    async fn rewind(&self, m: &ChannelMessage, delay: Duration) -> Result<(), SubscriptionError> {
        let seq = m.stored.seq;
        self.broker.with_group(&self.group, |g| {
            if g.pending.remove(&seq).is_some() {
                g.rewound.insert(seq, Instant::now() + delay);
            }
        });
        self.broker.published.notify_waiters();
        Ok(())
    }

    async fn term(&self, m: &ChannelMessage, _reason: &str) -> Result<(), SubscriptionError> {
        self.broker.end(&self.group, m.stored.seq);
        Ok(())
    }

    async fn renew(&self, m: &ChannelMessage) -> Result<(), SubscriptionError> {
        let (seq, at) = (m.stored.seq, Instant::now() + self.ack_wait);
        self.broker.with_group(&self.group, |g| {
            if let Some(dl) = g.pending.get_mut(&seq) {
                *dl = at;
            }
        });
        Ok(())
    }

    async fn dead_letter(
        &self,
        m: &ChannelMessage,
        letter: &DeadLetter<'_>,
    ) -> Result<(), SubscriptionError> {
        let added = letter.headers(&[
            ("Topic", m.stored.topic.clone()),
            ("Sequence", m.stored.seq.to_string()),
        ]);
        self.broker
            .state
            .lock()
            .expect("poisoned")
            .dead_letters
            .push((m.stored.seq, added));
        Ok(())
    }
}
