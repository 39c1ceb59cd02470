//! Inbox metrics through the [`metrics`] facade (feature `metrics`), as an [`InboxHooks`]
//! implementation: add [`InboxMetrics`] to a runner's or a processor's hooks (contract R168,
//! R169). Names take the optional prefix of R70.
//!
//! | name | type | counts |
//! |---|---|---|
//! | `inbox_messages_consumed_total` | counter | deliveries read |
//! | `inbox_messages_committed_total` | counter | commits confirmed |
//! | `inbox_commit_failures_total` | counter | commits failed or unconfirmed |
//! | `inbox_messages_duplicate_total` | counter | duplicate deliveries and duplicate siblings |
//! | `inbox_messages_processed_total` | counter | handler runs ending in success |
//! | `inbox_messages_failed_total` | counter | handler runs ending in a failure |
//! | `inbox_events_processed_total{event_type,status}` | counter | runs and duplicates: `success`, `failure`, `skipped` |
//! | `inbox_handler_duration_seconds{event_type}` | histogram | every handler run |
//! | `inbox_messages_rewound_total` | counter | rewinds |
//! | `inbox_messages_invalid_total{reason}` | counter | invalid deliveries by R139's label |
//! | `inbox_persist_failures_total` | counter | persistence errors |
//! | `inbox_locked_batch_size` | gauge | rows of the processor's last fetch |
//! | `inbox_transaction_messages{side}` | histogram | messages (rows) per transaction, `runner` or `processor` (R190) |
//! | `inbox_transaction_seconds{side}` | histogram | a transaction's time from begin to its end (R190) |
//! | `inbox_batch_fallbacks_total{reason}` | counter | batches that fell back: `handler`, `refused`, `deadlock`, `connection`, `commit` (R190) |
//! | `inbox_parked_keys{consumer_group}` | gauge | by [`InboxMetrics::update_parked`]: the group's keys with a parked row (R193) |
//! | `inbox_parked_rows{consumer_group}` | gauge | by [`InboxMetrics::update_parked`]: the group's parked rows, keyless rows included (R193) |
//!
//! The parked gauges are not hooks: the application (or an operator task) calls
//! [`InboxMetrics::update_parked`] on its schedule, as the outbox's backlog gauges are.
//!
//! A handler's status text never becomes a label (R169); rows a shutdown released count nowhere.

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::error::{ConfigError, RepositoryError};
use crate::inbox::hooks::{InboxHooks, TransactionReport};
use crate::inbox::model::ConsumerGroup;
use crate::inbox::processor::RowReport;
use crate::inbox::repository::InboxRepository;
use crate::inbox::runner::{DeliveryOutcome, DeliveryResult};

#[derive(Debug)]
struct Names {
    consumed: String,
    committed: String,
    commit_failures: String,
    duplicate: String,
    processed: String,
    failed: String,
    events: String,
    duration: String,
    rewound: String,
    invalid: String,
    persist: String,
    batch: String,
    tx_messages: String,
    tx_seconds: String,
    fallbacks: String,
    parked_keys: String,
    parked_rows: String,
}

/// The inbox's metrics (R168), recorded from the hooks.
#[derive(Debug, Clone)]
pub struct InboxMetrics {
    names: Arc<Names>,
}

impl Default for InboxMetrics {
    fn default() -> Self {
        Self::named("")
    }
}

impl InboxMetrics {
    /// Metrics without a prefix.
    pub fn new() -> Self {
        Self::default()
    }

    /// Metrics whose names start with `prefix_` (`^[a-zA-Z_][a-zA-Z0-9_]*$`, R70).
    pub fn with_prefix(prefix: &str) -> Result<Self, ConfigError> {
        // The outbox's metrics check the same rule; reuse it.
        crate::metrics::MetricsStep::with_prefix(prefix)?;
        Ok(Self::named(&format!("{prefix}_")))
    }

    fn named(p: &str) -> Self {
        let n = |s: &str| format!("{p}{s}");
        Self {
            names: Arc::new(Names {
                consumed: n("inbox_messages_consumed_total"),
                committed: n("inbox_messages_committed_total"),
                commit_failures: n("inbox_commit_failures_total"),
                duplicate: n("inbox_messages_duplicate_total"),
                processed: n("inbox_messages_processed_total"),
                failed: n("inbox_messages_failed_total"),
                events: n("inbox_events_processed_total"),
                duration: n("inbox_handler_duration_seconds"),
                rewound: n("inbox_messages_rewound_total"),
                invalid: n("inbox_messages_invalid_total"),
                persist: n("inbox_persist_failures_total"),
                batch: n("inbox_locked_batch_size"),
                tx_messages: n("inbox_transaction_messages"),
                tx_seconds: n("inbox_transaction_seconds"),
                fallbacks: n("inbox_batch_fallbacks_total"),
                parked_keys: n("inbox_parked_keys"),
                parked_rows: n("inbox_parked_rows"),
            }),
        }
    }

    /// Queries the group's parked keys and rows and sets `inbox_parked_keys` and
    /// `inbox_parked_rows` with the label `consumer_group` (R193); returns (keys, rows).
    pub async fn update_parked(
        &self,
        repo: &dyn InboxRepository,
        group: &ConsumerGroup,
    ) -> Result<(u64, u64), RepositoryError> {
        let (keys, rows) = repo.parked_counts(group).await?;
        let g = group.as_str().to_owned();
        metrics::gauge!(self.names.parked_keys.clone(), "consumer_group" => g.clone())
            .set(keys as f64);
        metrics::gauge!(self.names.parked_rows.clone(), "consumer_group" => g).set(rows as f64);
        Ok((keys, rows))
    }

    fn inc(&self, name: &str) {
        metrics::counter!(name.to_owned()).increment(1);
    }

    fn event(&self, event_type: &str, status: &'static str) {
        metrics::counter!(self.names.events.clone(), "event_type" => event_type.to_owned(), "status" => status)
            .increment(1);
    }

    fn run(&self, event_type: &str, success: Option<bool>, skipped: bool, d: Option<Duration>) {
        if let Some(d) = d {
            metrics::histogram!(self.names.duration.clone(), "event_type" => event_type.to_owned())
                .record(d.as_secs_f64());
        }
        match success {
            Some(true) if skipped => self.event(event_type, "skipped"),
            Some(true) => {
                self.inc(&self.names.processed);
                self.event(event_type, "success");
            }
            Some(false) => {
                self.inc(&self.names.failed);
                self.event(event_type, "failure");
            }
            None => {}
        }
    }
}

impl InboxHooks for InboxMetrics {
    fn on_delivery(&self, r: &DeliveryResult) {
        let n = &self.names;
        self.inc(&n.consumed);
        if r.committed {
            self.inc(&n.committed);
        }
        if r.commit_failed {
            self.inc(&n.commit_failures);
        }
        if r.rewind_delay.is_some() {
            self.inc(&n.rewound);
        }
        let et = r.event_type.as_deref().unwrap_or("");
        match r.outcome {
            DeliveryOutcome::Duplicate if r.handler_duration.is_none() => {
                self.inc(&n.duplicate);
                self.event(et, "skipped");
            }
            DeliveryOutcome::Invalid => {
                metrics::counter!(n.invalid.clone(), "reason" => r.invalid_label.unwrap_or("field"))
                    .increment(1);
            }
            DeliveryOutcome::PersistFailed => self.inc(&n.persist),
            _ => {}
        }
        if r.handler_duration.is_some() {
            let (ok, skipped) = match r.outcome {
                DeliveryOutcome::Completed => (true, false),
                DeliveryOutcome::Skipped => (true, true),
                _ => (false, false),
            };
            self.run(et, Some(ok), skipped, r.handler_duration);
        }
    }

    fn on_persist_failure(&self, r: &DeliveryResult) {
        self.on_delivery(r);
    }

    fn on_transaction(&self, t: &TransactionReport) {
        let n = &self.names;
        let side = t.side.as_str();
        metrics::histogram!(n.tx_messages.clone(), "side" => side).record(t.messages as f64);
        metrics::histogram!(n.tx_seconds.clone(), "side" => side).record(t.elapsed.as_secs_f64());
        if let Some(reason) = t.fallback {
            metrics::counter!(n.fallbacks.clone(), "reason" => reason.as_str()).increment(1);
        }
    }

    fn on_fetch(&self, rows: usize) {
        metrics::gauge!(self.names.batch.clone()).set(rows as f64);
    }

    fn on_row(&self, _id: Uuid, event_type: Option<&str>, report: &RowReport, d: Option<Duration>) {
        let et = event_type.unwrap_or("");
        match report {
            RowReport::Completed { .. } => self.run(et, Some(true), false, d),
            RowReport::Skipped { .. } => self.run(et, Some(true), true, d),
            RowReport::Counted { .. } | RowReport::NotCounted { .. } => {
                self.run(et, Some(false), false, d)
            }
            RowReport::Duplicate { .. } => {
                self.inc(&self.names.duplicate);
                self.event(et, "skipped");
            }
            RowReport::CommitFailed { .. } => self.run(et, None, false, d),
            RowReport::Released | RowReport::LeaseLost => {}
        }
    }
}

/// Conformance scenario A-03 on the in-memory inbox (the suite's harness cannot install a
/// recorder for one trial): the counters of R168 per outcome, with a prefix.
#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use async_trait::async_trait;
    use serde_json::json;

    use super::*;
    use crate::CancellationToken;
    use crate::clock::ManualClock;
    use crate::inbox::memory::{InMemoryInbox, MemInboxTx};
    use crate::inbox::scripted::{MessageFactory, ScriptedSubscription};
    use crate::inbox::{
        Handler, HandlerError, HandlerOutcome, InboxEvent, NewInboxEvent, OnFailure, Processor,
        Runner,
    };
    use crate::metrics::tests::Rec;

    struct H;

    #[async_trait]
    impl Handler<MemInboxTx> for H {
        async fn handle(
            &self,
            row: &InboxEvent,
            tx: &mut MemInboxTx,
        ) -> Result<HandlerOutcome, HandlerError> {
            tx.record(json!({ "message_id": row.message_id }));
            match row.message_id.as_str() {
                "m2" => Err(HandlerError::new("x")),
                "m3" => Ok(HandlerOutcome::skipped("")),
                _ => Ok(HandlerOutcome::completed()),
            }
        }
    }

    #[test]
    fn a_03_counters_per_outcome() {
        let rec = Rec::default();
        metrics::with_local_recorder(&rec, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let clock = ManualClock::starting_now();
                    let inbox = InMemoryInbox::new(Arc::new(clock.clone()));
                    let sub = ScriptedSubscription::new(Arc::new(clock.clone()));
                    let f = MessageFactory::new();
                    let m = |id: &str| {
                        f.nats(
                            &[("event_id", id), ("topic", "src"), ("event_type", "e")],
                            "{\"n\": 1}",
                        )
                    };
                    let hooks = Arc::new(InboxMetrics::with_prefix("svc").unwrap());
                    let runner = Runner::builder(inbox.clone(), Arc::new(sub.clone()), "g")
                        .handler(Arc::new(H))
                        .worker_id("w1")
                        .process_stored(false)
                        .on_failure(OnFailure::Rewind)
                        .hooks(hooks.clone())
                        .build()
                        .unwrap();
                    let m1 = sub.push(m("m1"));
                    runner.handle_next().await.unwrap();
                    sub.duplicate(m1);
                    runner.handle_next().await.unwrap();
                    sub.push(m("m2"));
                    runner.handle_next().await.unwrap();
                    sub.push(m("m3"));
                    runner.handle_next().await.unwrap();
                    sub.push(f.nats(&[], "not json"));
                    runner.handle_next().await.unwrap();
                    let m4 = sub.push(m("m4"));
                    sub.fail_commit(m4);
                    runner.handle_next().await.unwrap();
                    sub.push(m("m5"));
                    inbox.set_down(true);
                    runner.handle_next().await.unwrap();
                    inbox.set_down(false);
                    let snapshot = |id: &str| rec.get(id).counter.load(Ordering::SeqCst);
                    assert_eq!(snapshot("svc_inbox_messages_consumed_total{}"), 7);
                    assert_eq!(snapshot("svc_inbox_messages_committed_total{}"), 3);
                    assert_eq!(snapshot("svc_inbox_commit_failures_total{}"), 1);
                    assert_eq!(snapshot("svc_inbox_messages_duplicate_total{}"), 1);
                    assert_eq!(snapshot("svc_inbox_messages_processed_total{}"), 2);
                    assert_eq!(snapshot("svc_inbox_messages_failed_total{}"), 1);
                    assert_eq!(snapshot("svc_inbox_messages_rewound_total{}"), 2);
                    assert_eq!(
                        snapshot("svc_inbox_messages_invalid_total{reason=not_json}"),
                        1
                    );
                    assert_eq!(snapshot("svc_inbox_persist_failures_total{}"), 1);
                    let ev = |s: &str| {
                        snapshot(&format!(
                            "svc_inbox_events_processed_total{{event_type=e,status={s}}}"
                        ))
                    };
                    assert_eq!((ev("success"), ev("failure"), ev("skipped")), (2, 1, 2));
                    let obs = || {
                        rec.get("svc_inbox_handler_duration_seconds{event_type=e}")
                            .observations
                            .lock()
                            .unwrap()
                            .len()
                    };
                    assert_eq!(obs(), 4);
                    // A processor cycle over three landed rows, then one over none.
                    let mut tx = crate::inbox::repository::InboxBackend::begin(&inbox)
                        .await
                        .unwrap();
                    for id in ["p1", "p2", "p3"] {
                        let e = NewInboxEvent::builder()
                            .message_id(id)
                            .consumer_group("g")
                            .source("src")
                            .event_type("e")
                            .payload_json(json!({"n": 1}))
                            .build()
                            .unwrap();
                        crate::inbox::repository::InboxTransaction::land(&mut tx, vec![e])
                            .await
                            .unwrap();
                    }
                    crate::inbox::repository::InboxTransaction::commit(tx)
                        .await
                        .unwrap();
                    let p = Processor::builder(inbox.clone(), "g", Arc::new(H))
                        .worker_id("p1")
                        .hooks(hooks.clone())
                        .build()
                        .unwrap();
                    p.cycle(&CancellationToken::new()).await.unwrap();
                    let gauge = || {
                        *rec.get("svc_inbox_locked_batch_size{}")
                            .gauge
                            .lock()
                            .unwrap()
                    };
                    assert_eq!(gauge(), 3.0);
                    assert_eq!(snapshot("svc_inbox_messages_processed_total{}"), 5);
                    assert_eq!(ev("success"), 5);
                    assert_eq!(obs(), 7);
                    p.cycle(&CancellationToken::new()).await.unwrap();
                    assert_eq!(gauge(), 0.0);
                });
        });
        assert!(InboxMetrics::with_prefix("1x").is_err());
    }

    struct Fails;

    #[async_trait]
    impl Handler<MemInboxTx> for Fails {
        async fn handle(
            &self,
            _: &InboxEvent,
            _: &mut MemInboxTx,
        ) -> Result<HandlerOutcome, HandlerError> {
            Err(HandlerError::new("poison"))
        }
    }

    /// R193: after a processor parks a keyed row and a keyless one (on_exhausted park, one
    /// attempt each), `inbox_parked_keys{consumer_group}` is 1 and `inbox_parked_rows` 2.
    #[tokio::test]
    async fn a_park_sets_the_parked_gauges() {
        let rec = Rec::default();
        let clock = ManualClock::starting_now();
        let inbox = InMemoryInbox::new(Arc::new(clock.clone()));
        let mut tx = crate::inbox::repository::InboxBackend::begin(&inbox)
            .await
            .unwrap();
        for (id, key) in [("p1", Some("k")), ("p2", None)] {
            let mut e = NewInboxEvent::builder()
                .message_id(id)
                .consumer_group("g")
                .source("src")
                .event_type("e")
                .payload_json(json!({"n": 1}))
                .max_attempts(1);
            if let Some(k) = key {
                e = e.partition_key(k);
            }
            crate::inbox::repository::InboxTransaction::land(&mut tx, vec![e.build().unwrap()])
                .await
                .unwrap();
        }
        crate::inbox::repository::InboxTransaction::commit(tx)
            .await
            .unwrap();
        let p = Processor::builder(inbox.clone(), "g", Arc::new(Fails))
            .worker_id("p1")
            .on_exhausted(crate::repository::OnExhausted::Park)
            .build()
            .unwrap();
        p.cycle(&CancellationToken::new()).await.unwrap();
        let m = InboxMetrics::new();
        let g = ConsumerGroup::new("g").unwrap();
        let counts = metrics::with_local_recorder(&rec, || {
            futures::executor::block_on(m.update_parked(&inbox, &g))
        })
        .unwrap();
        assert_eq!(counts, (1, 2));
        let gauge = |id: &str| *rec.get(id).gauge.lock().unwrap();
        assert_eq!(gauge("inbox_parked_keys{consumer_group=g}"), 1.0);
        assert_eq!(gauge("inbox_parked_rows{consumer_group=g}"), 2.0);
    }
}
