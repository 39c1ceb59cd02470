//! The in-memory backend's harness (the suite's reference run).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::OwnedMutexGuard;
use txoutbox_core::clock::ManualClock;
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::NewEvent;
use txoutbox_core::memory::{InMemoryRepository, MemTransaction};
use txoutbox_core::repository::{OutboxRepository, WriteResult};
use uuid::Uuid;

use crate::harness::{BackendKind, Factory, Harness, RowPatch, WriteTx};

/// A fresh in-memory store on a manual clock.
#[derive(Debug, Clone)]
pub struct MemHarness {
    /// The repository.
    pub repo: InMemoryRepository,
    /// Its clock.
    pub clock: ManualClock,
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl Default for MemHarness {
    fn default() -> Self {
        Self::new()
    }
}

impl MemHarness {
    /// A fresh store.
    pub fn new() -> Self {
        let clock = ManualClock::starting_now();
        Self {
            repo: InMemoryRepository::new(Arc::new(clock.clone())),
            clock,
            locks: Arc::default(),
        }
    }
}

struct MemTx {
    tx: Option<MemTransaction>,
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    held: Vec<OwnedMutexGuard<()>>,
}

#[async_trait]
impl WriteTx for MemTx {
    async fn write(&mut self, events: Vec<NewEvent>) -> Result<Vec<WriteResult>, RepositoryError> {
        self.tx.as_mut().expect("open").write(events).await
    }
    async fn lock_app(&mut self, name: &str) {
        let m = self
            .locks
            .lock()
            .expect("poisoned")
            .entry(name.to_owned())
            .or_default()
            .clone();
        self.held.push(m.lock_owned().await);
    }
    async fn touch(&mut self) {
        self.tx.as_mut().expect("open").touch();
    }
    async fn commit(mut self: Box<Self>) -> Result<(), RepositoryError> {
        self.tx.take().expect("open").commit();
        self.held.clear();
        Ok(())
    }
    async fn rollback(mut self: Box<Self>) -> Result<(), RepositoryError> {
        self.tx.take().expect("open").rollback();
        self.held.clear();
        Ok(())
    }
}

#[async_trait]
impl Harness for MemHarness {
    fn kind(&self) -> BackendKind {
        BackendKind::Memory
    }
    fn repository(&self) -> Arc<dyn OutboxRepository> {
        Arc::new(self.repo.clone())
    }
    async fn begin(&self) -> Box<dyn WriteTx> {
        Box::new(MemTx {
            tx: Some(self.repo.begin()),
            locks: self.locks.clone(),
            held: Vec::new(),
        })
    }
    async fn advance(&self, d: Duration) {
        // The backend's now may stand a few µs past the clock (created_at is raised 1 µs per
        // write call, R73); advance from there, so "d passes" for every stored time.
        let now = self.repo.now().await.expect("memory now");
        self.clock
            .set(now + chrono::Duration::from_std(d).expect("duration"));
    }
    async fn set(&self, id: Uuid, p: RowPatch) {
        let found = self.repo.set(id, |r| {
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
        assert!(found, "set: no row {id}");
    }
    fn fail_next_outcome_commit(&self) {
        self.repo.fail_next_outcome_commit();
    }
    fn try_configure(
        &self,
        batch_size: usize,
        error_max_length: usize,
    ) -> Option<Result<(), String>> {
        Some(
            txoutbox_core::memory::MemoryConfig::default()
                .batch_size(batch_size)
                .and_then(|c| c.error_max_length(error_max_length))
                .map(|_| ())
                .map_err(|e| e.to_string()),
        )
    }
}

/// Makes a fresh [`MemHarness`] per trial.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemFactory;

#[async_trait]
impl Factory for MemFactory {
    async fn create(&self) -> Arc<dyn Harness> {
        Arc::new(MemHarness::new())
    }
}
