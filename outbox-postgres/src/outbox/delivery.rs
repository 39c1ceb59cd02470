//! An open delivery transaction (R84), for every driver.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use async_trait::async_trait;
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::WorkerId;
use txoutbox_core::repository::{Delivery, Outcome, OutcomeResult, WrittenOutcome};
use uuid::Uuid;

use super::Repository;
use super::repository::{injected, write_outcome_rows};
use crate::driver::outbox::OutboxDriver;
use crate::shared::{self, OutcomeBinds};

/// The delivery transaction of a cycle: the taken rows stay locked by it until it commits
/// the outcomes. Dropping it rolls back (the driver's transaction handle does).
pub(crate) struct OpenDelivery<D: OutboxDriver> {
    pub(crate) tx: Option<D::Tx>,
    pub(crate) repo: Repository<D>,
    pub(crate) worker: WorkerId,
    pub(crate) fetched: HashMap<Uuid, OutcomeResult>,
}

#[async_trait]
impl<D: OutboxDriver> Delivery for OpenDelivery<D> {
    async fn commit(
        mut self: Box<Self>,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        let repo = self.repo.clone();
        let table = &repo.cfg.table;
        let mut tx = self.tx.take().expect("a delivery commits once");
        let b = OutcomeBinds::new(
            &shared::delivery_writes(outcomes),
            repo.cfg.error_max_length,
        );
        let s = &repo.stmts;
        let sqls = [
            Some(s.complete_in_delivery.as_str()),
            Some(s.fail_in_delivery.as_str()),
            None,
        ];
        let results = write_outcome_rows(&mut *tx, table, sqls, b, self.worker.as_str()).await;
        let results = match results {
            Ok(_) if repo.fail_next_commit.swap(false, Ordering::SeqCst) => Err(injected()),
            r => r,
        };
        // Roll back on an error now, so the rows are free before this returns (TX-02).
        let results = crate::driver::finish::<D, _>(table, tx, results).await?;
        Ok(shared::delivery_outcomes(outcomes, &results, &self.fetched))
    }

    async fn rollback(mut self: Box<Self>) {
        if let Some(tx) = self.tx.take() {
            let _ = D::rollback(&self.repo.cfg.table, tx).await;
        }
    }
}
