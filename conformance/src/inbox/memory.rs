//! The in-memory inbox's harness (the suite's reference run).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use txoutbox_core::clock::{Clock, ManualClock};
use txoutbox_core::inbox::HandlerError;
use txoutbox_core::inbox::memory::{InMemoryInbox, MemInboxTx};
use txoutbox_core::inbox::repository::InboxRepository;
use uuid::Uuid;

use crate::harness::BackendKind;
use crate::inbox::harness::{InboxFactory, InboxHarness, InboxPatch};

/// A fresh in-memory inbox on a manual clock.
#[derive(Debug, Clone)]
pub struct MemInboxHarness {
    /// The inbox.
    pub inbox: InMemoryInbox,
    /// Its clock.
    pub clock: ManualClock,
}

impl Default for MemInboxHarness {
    fn default() -> Self {
        let clock = ManualClock::starting_now();
        Self {
            inbox: InMemoryInbox::new(Arc::new(clock.clone())),
            clock,
        }
    }
}

#[async_trait]
impl InboxHarness for MemInboxHarness {
    type Backend = InMemoryInbox;
    fn kind(&self) -> BackendKind {
        BackendKind::Memory
    }
    fn backend(&self) -> InMemoryInbox {
        self.inbox.clone()
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(self.clock.clone())
    }
    async fn advance(&self, d: Duration) {
        let now = self.inbox.now().await.expect("memory now");
        self.clock
            .set(now + chrono::Duration::from_std(d).expect("duration"));
    }
    async fn set(&self, id: Uuid, p: InboxPatch) {
        let found = self.inbox.set(id, |r| {
            if let Some(v) = p.status {
                r.status = v;
            }
            if let Some(v) = p.attempts_made {
                r.attempts_made = v;
            }
            if let Some(v) = p.max_attempts {
                r.max_attempts = v;
            }
            if let Some(v) = p.last_error {
                r.last_error = v;
            }
            if let Some(v) = p.scheduled_at {
                r.scheduled_at = v;
            }
            if let Some(v) = p.completed_at {
                r.completed_at = v;
            }
            if let Some(v) = p.lock {
                r.locked_by = v.as_ref().map(|(w, _)| w.clone());
                r.locked_at = v.map(|(_, t)| t);
            }
        });
        assert!(found, "set: no inbox row {id}");
    }
    fn fail_next_row_commit(&self) {
        self.inbox.fail_next_commit();
    }
    fn set_db_down(&self, down: bool) {
        self.inbox.set_down(down);
    }
    fn before_next_begin(&self, f: futures::future::BoxFuture<'static, ()>) {
        // The memory fixtures complete without waiting, so the future runs to its end here.
        self.inbox
            .before_next_begin(move || futures::executor::block_on(f));
    }
    async fn effects(&self) -> Vec<String> {
        self.inbox
            .records()
            .into_iter()
            .filter_map(|v| v["message_id"].as_str().map(str::to_owned))
            .collect()
    }
    async fn write_effect(
        &self,
        tx: &mut MemInboxTx,
        message_id: &str,
        key: Option<&str>,
        n: i64,
    ) -> Result<(), HandlerError> {
        tx.record(json!({"message_id": message_id, "key": key, "n": n}));
        Ok(())
    }
    async fn break_tx(&self, tx: &mut MemInboxTx) {
        tx.break_transaction();
    }
}

/// Makes a fresh [`MemInboxHarness`] per trial.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemInboxFactory;

#[async_trait]
impl InboxFactory for MemInboxFactory {
    type Harness = MemInboxHarness;
    async fn create(&self) -> Arc<MemInboxHarness> {
        Arc::new(MemInboxHarness::default())
    }
}
