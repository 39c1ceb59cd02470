//! The inbox scenario toolkit: a trial's harness, scripted subscription and handler, and the
//! suite's conventions (group `g`, worker `w1`, source `src`, "m1 on k" messages).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use txoutbox_core::CancellationToken;
use txoutbox_core::backoff::{Backoff, SeededRng};
use txoutbox_core::inbox::decode::BrokerMessage;
use txoutbox_core::inbox::repository::{InboxBackend, InboxRepository, InboxTransaction};
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{
    ConsumerGroup, DeliveryResult, InboxCycleReport, InboxEvent, NewInboxEvent, Processor,
    ProcessorBuilder, Runner, RunnerBuilder,
};

use crate::inbox::harness::{InboxFactory, InboxHarness, InboxPatch};
use crate::inbox::script::{Act, ScriptedHandler};

/// One trial.
pub struct Ictx<H: InboxHarness> {
    /// The harness.
    pub h: Arc<H>,
    /// The scripted subscription.
    pub sub: ScriptedSubscription,
    /// Its message numbering.
    pub msgs: MessageFactory,
    /// The scripted handler (shared by every runner and processor of the trial).
    pub handler: Arc<ScriptedHandler<H>>,
    /// The hooks of every runner and processor of the trial.
    pub rec: Arc<Recorder>,
    counters: Mutex<HashMap<String, i64>>,
    ids: Mutex<HashMap<String, usize>>,
}

/// A hook that records what the runners and processors of a trial report.
#[derive(Default)]
pub struct Recorder {
    /// Delivery results, in order.
    pub deliveries: Mutex<Vec<DeliveryResult>>,
    /// When each delivery result and each processor fetch was reported (tokio's clock).
    pub times: Mutex<Vec<(String, tokio::time::Instant)>>,
    /// Terminal failures: (message_id, status of the row as before, error).
    pub terminal: Mutex<Vec<(String, txoutbox_core::event::Status, i32, String)>>,
    /// The transactions the runners and processors reported (R190), in order.
    pub transactions: Mutex<Vec<txoutbox_core::inbox::TransactionReport>>,
    /// Parks (R193): (message_id, attempts_made of the row as before, error).
    pub parked: Mutex<Vec<(String, i32, String)>>,
    changed: tokio::sync::Notify,
}

impl Recorder {
    /// Waits until at least `n` delivery results were recorded (bounded by 120 s of tokio time).
    pub async fn wait_deliveries(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let notified = self.changed.notified();
            if self.deliveries.lock().expect("poisoned").len() >= n {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("timed out waiting for {n} delivery results");
            }
        }
    }
    /// The recorded results.
    pub fn results(&self) -> Vec<DeliveryResult> {
        self.deliveries.lock().expect("poisoned").clone()
    }
    /// The message ids of the terminal failures.
    pub fn terminal_ids(&self) -> Vec<String> {
        self.terminal
            .lock()
            .expect("poisoned")
            .iter()
            .map(|t| t.0.clone())
            .collect()
    }
}

impl txoutbox_core::inbox::InboxHooks for Recorder {
    fn on_fetch(&self, _rows: usize) {
        self.times
            .lock()
            .expect("poisoned")
            .push(("fetch".into(), tokio::time::Instant::now()));
    }
    fn on_delivery(&self, r: &DeliveryResult) {
        self.times.lock().expect("poisoned").push((
            r.message_id.clone().unwrap_or_default(),
            tokio::time::Instant::now(),
        ));
        self.deliveries.lock().expect("poisoned").push(r.clone());
        self.changed.notify_waiters();
    }
    fn on_persist_failure(&self, r: &DeliveryResult) {
        self.on_delivery(r);
    }
    fn on_transaction(&self, t: &txoutbox_core::inbox::TransactionReport) {
        self.transactions.lock().expect("poisoned").push(t.clone());
    }
    fn on_parked(&self, row: &InboxEvent, error: &str) {
        self.parked.lock().expect("poisoned").push((
            row.message_id.clone(),
            row.attempts_made,
            error.to_owned(),
        ));
    }
    fn on_terminal_failure(&self, row: &InboxEvent, error: &str) {
        self.terminal.lock().expect("poisoned").push((
            row.message_id.clone(),
            row.status,
            row.attempts_made,
            error.to_owned(),
        ));
    }
}

tokio::task_local! {
    /// The `rows_per_transaction` (R183) of the processors [`Ictx::processor`] builds in a
    /// trial run inside [`ROWS_PER_TRANSACTION`]`.scope(n, …)`; outside, the default (16). The
    /// suite runs the processor scenarios again with 1 this way (`inbox_suite!`'s
    /// `one_row_per_transaction` module).
    pub static ROWS_PER_TRANSACTION: usize;
}

/// The group of every scenario.
pub fn g() -> ConsumerGroup {
    ConsumerGroup::new("g").expect("group")
}

impl<H: InboxHarness> Ictx<H> {
    /// A fresh trial.
    pub async fn new<F: InboxFactory<Harness = H>>(f: &F) -> Self {
        let h = f.create().await;
        let sub = ScriptedSubscription::new(h.clock());
        Self {
            handler: Arc::new(ScriptedHandler::new(h.clone())),
            h,
            sub,
            rec: Arc::default(),
            msgs: MessageFactory::new(),
            counters: Mutex::default(),
            ids: Mutex::default(),
        }
    }

    /// The backend.
    pub fn backend(&self) -> H::Backend {
        self.h.backend()
    }

    fn next_n(&self, key: &str) -> i64 {
        let mut c = self.counters.lock().expect("poisoned");
        let n = c.entry(key.to_owned()).or_insert(0);
        let v = *n;
        *n += 1;
        v
    }

    /// "m1 on k" (or "m1" without a key): headers event_id, partition_key, topic `src`,
    /// event_type `e`; body `{"key": k, "n": i}`.
    pub fn msg(&self, id: &str, key: Option<&str>) -> BrokerMessage {
        let k = key.unwrap_or("");
        let n = self.next_n(k);
        let body = json!({"key": key, "n": n}).to_string();
        let mut headers = vec![("event_id", id), ("topic", "src"), ("event_type", "e")];
        if let Some(k) = key {
            headers.push(("partition_key", k));
        }
        self.msgs.nats(&headers, &body)
    }

    /// Queues "id on key" for delivery; returns its index in the subscription.
    pub fn deliver(&self, id: &str, key: Option<&str>) -> usize {
        let i = self.sub.push(self.msg(id, key));
        self.ids.lock().expect("poisoned").insert(id.to_owned(), i);
        i
    }

    /// The subscription index of a message queued by [`deliver`](Self::deliver).
    pub fn idx(&self, id: &str) -> usize {
        self.ids.lock().expect("poisoned")[id]
    }

    /// `duplicate(m)`.
    pub fn duplicate(&self, id: &str) {
        self.sub.duplicate(self.idx(id));
    }

    /// A script for a message.
    pub fn script(&self, id: &str, acts: Vec<Act>) {
        self.handler.script(id, acts);
    }

    /// A runner builder with the suite's defaults and the scripted handler.
    pub fn runner(&self) -> RunnerBuilder<H::Backend> {
        self.bare_runner().handler(self.handler.clone())
    }

    /// A runner builder with the suite's defaults and no handler.
    pub fn bare_runner(&self) -> RunnerBuilder<H::Backend> {
        Runner::builder(self.backend(), Arc::new(self.sub.clone()), "g")
            .worker_id("w1")
            .messages_per_transaction(1)
            .concurrency(1)
            .process_stored(false)
            .sources(["src"])
            .hooks(self.rec.clone())
            .random_source(Box::new(SeededRng::new(7)))
    }

    /// A processor builder with the suite's defaults.
    pub fn processor(&self) -> ProcessorBuilder<H::Backend> {
        Processor::builder(self.backend(), "g", self.handler.clone())
            .worker_id("p1")
            .batch_size(100)
            .max_per_key(1)
            .handler_concurrency(1)
            .rows_per_transaction(
                ROWS_PER_TRANSACTION
                    .try_with(|n| *n)
                    .unwrap_or(txoutbox_core::inbox::processor::DEFAULT_ROWS_PER_TRANSACTION),
            )
            .hooks(self.rec.clone())
            .random_source(Box::new(SeededRng::new(11)))
    }

    /// One processor cycle.
    pub async fn cycle(&self, p: &Processor<H::Backend>) -> InboxCycleReport {
        p.cycle(&CancellationToken::new())
            .await
            .expect("processor cycle")
    }

    /// Handles the next delivery; panics when there is none.
    pub async fn handle(&self, r: &Runner<H::Backend>) -> DeliveryResult {
        r.handle_next()
            .await
            .expect("subscription read")
            .expect("a delivery is waiting")
    }

    /// "Landed m1 on k": stored by `land`, committed.
    pub async fn land(&self, id: &str, key: Option<&str>) -> InboxEvent {
        self.land_in("g", "src", id, key).await
    }

    /// A landed row of another group or source.
    pub async fn land_in(
        &self,
        group: &str,
        source: &str,
        id: &str,
        key: Option<&str>,
    ) -> InboxEvent {
        let n = self.next_n(key.unwrap_or(""));
        let mut b = NewInboxEvent::builder()
            .message_id(id)
            .consumer_group(group)
            .source(source)
            .event_type("e")
            .payload_json(json!({"key": key, "n": n}));
        if let Some(k) = key {
            b = b.partition_key(k);
        }
        let mut tx = self.backend().begin().await.expect("begin");
        let l = tx
            .land(vec![b.build().expect("valid event")])
            .await
            .expect("land");
        tx.commit().await.expect("commit");
        l[0].row.clone()
    }

    /// The row of a message in group g.
    pub async fn row(&self, id: &str) -> Option<InboxEvent> {
        self.backend()
            .get_by_message_id(id, &g())
            .await
            .expect("get_by_message_id")
    }

    /// The row of a message; panics when there is none.
    pub async fn row_of(&self, id: &str) -> InboxEvent {
        self.row(id)
            .await
            .unwrap_or_else(|| panic!("no row for {id}"))
    }

    /// The backend's now.
    pub async fn now(&self) -> DateTime<Utc> {
        self.backend().now().await.expect("now")
    }

    /// `advance(d)`.
    pub async fn advance(&self, d: Duration) {
        self.h.advance(d).await;
    }

    /// `set(id, …)`.
    pub async fn set(&self, id: uuid::Uuid, p: InboxPatch) {
        self.h.set(id, p).await;
    }

    /// The committed effects.
    pub async fn effects(&self) -> Vec<String> {
        self.h.effects().await
    }

    /// Every stored row of group g, in write order.
    pub async fn count_rows(&self, ids: &[&str]) -> usize {
        let mut n = 0;
        for id in ids {
            if self.row(id).await.is_some() {
                n += 1;
            }
        }
        n
    }

    /// Backoff with this base and the default cap.
    pub fn backoff(base: f64) -> Backoff {
        Backoff::new(base, 3600.0).expect("backoff")
    }
}

/// Asserts `t − now ∈ [lo, hi]` seconds for the backend's `now` at the write, which lies between
/// `before` and `after` (read before and after it): on a frozen clock (memory) `before` equals
/// `after` and this is exact; on a database clock that moves during the run, the write's own
/// `now` is somewhere in between, so `t − before ≥ lo` and `t − after ≤ hi`.
pub fn assert_within(
    t: DateTime<Utc>,
    before: DateTime<Utc>,
    after: DateTime<Utc>,
    lo: f64,
    hi: f64,
    what: &str,
) {
    let a = (t - after).as_seconds_f64();
    let b = (t - before).as_seconds_f64();
    assert!(
        b >= lo - 1e-3 && a <= hi + 1e-3,
        "{what}: next try − now should be in [{lo}, {hi}] s, was {a} .. {b}"
    );
}
