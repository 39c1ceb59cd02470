//! One open inbox transaction of the store: the runner's T and the processor's T_row (R181),
//! its landing, guard, savepoint and row writes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::error::RepositoryError;
use outbox_core::event::{Status, WorkerId, limits, normalize_error};
use outbox_core::inbox::ordering as inbox_order;
use outbox_core::inbox::repository::{
    Guard, InboxTransaction, Landed, RowLock, RowWrite, WrittenState,
};
use outbox_core::inbox::{InboxEvent, InboxKey, NewInboxEvent};
use outbox_core::repository::Retry;
use uuid::Uuid;

use super::{Conn, InboxFaults, decoded, one};
use crate::driver::inbox::{
    InboxDriver, InboxRawRow, InboxRows, nullable_int8, nullable_text, nullable_timestamp,
};
use crate::driver::{Bind, Driver};
use crate::inbox::sql::InboxStatements;
use crate::sql::{Layout, micros};

/// One open inbox transaction over a driver transaction `T`.
pub struct PgInboxTx<D: Driver> {
    pub(super) tx: D::Tx,
    pub(super) stmts: Arc<InboxStatements>,
    pub(super) faults: Arc<InboxFaults>,
    pub(super) timeout_before: Option<String>,
}

impl<D: Driver> std::fmt::Debug for PgInboxTx<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgInboxTx")
            .field("table", &self.stmts.table)
            .finish()
    }
}

fn error_text(e: &str) -> String {
    normalize_error(
        &e.replace('\0', "\u{FFFD}"),
        limits::DEFAULT_ERROR_MAX_LENGTH,
    )
}

fn retry_binds(retry: &Retry) -> (Bind, Bind) {
    match retry {
        Retry::Keep => (nullable_int8(None), nullable_timestamp(None)),
        Retry::After(d) => (nullable_int8(Some(micros(*d))), nullable_timestamp(None)),
        Retry::At(t) => (nullable_int8(None), nullable_timestamp(Some(*t))),
    }
}

impl<D: Driver> PgInboxTx<D>
where
    D::Conn: InboxRows,
{
    fn c(&mut self) -> Conn<'_, D> {
        Conn {
            c: &mut *self.tx,
            table: &self.stmts.table,
        }
    }

    /// The statement `write` (R126, R128, R154): the row as written, undecoded.
    async fn write_raw(
        &mut self,
        id: Uuid,
        write: &RowWrite,
    ) -> Result<InboxRawRow, RepositoryError> {
        let s = self.stmts.clone();
        let (kind, error, (after, at)) = match write {
            RowWrite::Complete => ("complete", None, retry_binds(&Retry::Keep)),
            RowWrite::Counted { error, retry } => {
                ("counted", Some(error_text(error)), retry_binds(retry))
            }
            RowWrite::NotCounted { error, retry } => {
                ("not_counted", Some(error_text(error)), retry_binds(retry))
            }
            RowWrite::Terminal { error } => (
                "terminal",
                Some(error_text(error)),
                retry_binds(&Retry::Keep),
            ),
            RowWrite::ClearLease => ("clear_lease", None, retry_binds(&Retry::Keep)),
        };
        let binds = [
            Bind::Uuid(id),
            Bind::Text(String::from(kind)),
            nullable_text(error.as_deref()),
            after,
            at,
        ];
        self.c()
            .rows(&s.write, &binds)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| RepositoryError::Other(format!("inbox row {id} does not exist")))
    }

    async fn land_one(&mut self, e: &NewInboxEvent) -> Result<Landed, RepositoryError> {
        let s = self.stmts.clone();
        let key = [
            Bind::Text(String::from(e.message_id())),
            Bind::Text(String::from(e.consumer_group())),
        ];
        if s.layout == Layout::Partitioned {
            // A dedup key already stored needs no insert, so nothing to serialize: its row is
            // returned without the advisory lock, and a processor's T_row that holds the lock
            // while its handler runs (R152) is not waited for; the row lock that follows skips
            // that row (R116 step 3; G-05).
            if let Some(row) = one(self.c().rows(&s.by_message_id, &key).await?)? {
                return Ok(Landed {
                    row,
                    inserted: false,
                });
            }
            // R111: the dedup key's advisory lock, then the rows of the key.
            self.c().execute(&s.dedup_lock, &key).await?;
            if let Some(row) = one(self.c().rows(&s.by_message_id, &key).await?)? {
                return Ok(Landed {
                    row,
                    inserted: false,
                });
            }
        }
        let payload = serde_json::Value::Object(e.payload().clone()).to_string();
        let headers = e
            .headers()
            .map(|h| serde_json::to_string(h).expect("a string map serializes"));
        let row = e.clone().into_row(DateTime::<Utc>::MIN_UTC);
        let binds = [
            Bind::Uuid(e.id()),
            Bind::Text(String::from(e.event_type())),
            Bind::Text(payload),
            nullable_text(headers.as_deref()),
            nullable_text(row.trace_id.as_deref()),
            nullable_text(row.correlation_id.as_deref()),
            nullable_text(row.causation_id.as_deref()),
            nullable_text(row.schema_version.as_deref()),
            Bind::Int4(e.max_attempts()),
            Bind::Text(String::from(e.message_id())),
            Bind::Text(String::from(e.consumer_group())),
            Bind::Text(String::from(e.source())),
            nullable_text(e.partition_key()),
        ];
        if let Some(row) = one(self.c().rows(&s.land, &binds).await?)? {
            return Ok(Landed {
                row,
                inserted: true,
            });
        }
        match one(self.c().rows(&s.by_message_id, &key).await?)? {
            Some(row) => Ok(Landed {
                row,
                inserted: false,
            }),
            None => Err(RepositoryError::Other(format!(
                "landing message {} of group {} inserted nothing and found no row (an id conflict?)",
                e.message_id(),
                e.consumer_group()
            ))),
        }
    }
}

#[async_trait]
impl<D: InboxDriver> InboxTransaction for PgInboxTx<D> {
    type Handle = D::Handle;

    fn handle(&mut self) -> &mut D::Handle {
        D::handle(&mut self.tx)
    }

    async fn lock_key(&mut self, key: &InboxKey) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        let binds = [
            Bind::Text(String::from(key.consumer_group.as_str())),
            Bind::Text(String::from(key.source.as_str())),
            Bind::Text(String::from(key.partition_key.as_str())),
        ];
        self.c().execute(&s.key_lock, &binds).await?;
        Ok(())
    }

    async fn land(&mut self, events: Vec<NewInboxEvent>) -> Result<Vec<Landed>, RepositoryError> {
        let mut out = Vec::with_capacity(events.len());
        for e in &events {
            out.push(self.land_one(e).await?);
        }
        Ok(out)
    }

    async fn lock_row(&mut self, id: Uuid) -> Result<RowLock, RepositoryError> {
        let s = self.stmts.clone();
        if let Some(r) = one(self.c().rows(&s.lock_row, &[Bind::Uuid(id)]).await?)? {
            return Ok(RowLock::Locked(r));
        }
        Ok(match self.c().int8(&s.exists, &[Bind::Uuid(id)]).await? {
            Some(n) if n > 0 => RowLock::Busy,
            _ => RowLock::Missing,
        })
    }

    async fn earlier_in_line(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError> {
        let Some(pk) = row.partition_key.as_deref() else {
            return Ok(false);
        };
        let s = self.stmts.clone();
        let binds = [
            Bind::Text(String::from(row.consumer_group.as_str())),
            Bind::Text(String::from(row.source.as_str())),
            Bind::Text(String::from(pk)),
            Bind::Timestamp(row.created_at),
            Bind::Uuid(row.id),
        ];
        Ok(self.c().int8(&s.earlier, &binds).await?.unwrap_or(0) > 0)
    }

    async fn completed_sibling(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError> {
        if self.stmts.layout != Layout::Partitioned {
            // The unique index rules siblings out on the plain table (R164).
            return Ok(false);
        }
        let s = self.stmts.clone();
        let key = [
            Bind::Text(String::from(row.message_id.as_str())),
            Bind::Text(String::from(row.consumer_group.as_str())),
        ];
        self.c().execute(&s.dedup_lock, &key).await?;
        let binds = [key[0].clone(), key[1].clone(), Bind::Uuid(row.id)];
        Ok(self
            .c()
            .int8(&s.completed_sibling, &binds)
            .await?
            .unwrap_or(0)
            > 0)
    }

    async fn savepoint(&mut self, timeout: Duration) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        self.c().execute(&s.savepoint, &[]).await?;
        // Whole milliseconds, rounded up (R181); at least 1 (0 would turn the bound off).
        let ms = timeout.as_micros().div_ceil(1000).max(1);
        let before = self
            .c()
            .text(&s.statement_timeout, &[Bind::Text(ms.to_string())])
            .await?;
        self.timeout_before = before;
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        self.c().execute(&s.release_savepoint, &[]).await?;
        if let Some(before) = self.timeout_before.take() {
            self.c()
                .execute(&s.restore_timeout, &[Bind::Text(before)])
                .await?;
        }
        Ok(())
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), RepositoryError> {
        // The rollback also undoes the statement timeout's set_config.
        self.timeout_before = None;
        let s = self.stmts.clone();
        self.c().execute(&s.rollback_to_savepoint, &[]).await?;
        Ok(())
    }

    async fn write(&mut self, id: Uuid, write: RowWrite) -> Result<InboxEvent, RepositoryError> {
        decoded(self.write_raw(id, &write).await?)
    }

    async fn guard(&mut self, guard: &Guard) -> Result<Option<InboxEvent>, RepositoryError> {
        let s = self.stmts.clone();
        match guard {
            Guard::Reland(e) => {
                let l = self.land_one(e).await?;
                Ok(l.inserted.then_some(l.row))
            }
            Guard::Unchanged {
                id,
                attempts_made,
                scheduled_at,
                lease_ttl,
            } => {
                let now = self.c().now(&s.now).await?;
                Ok(match self.lock_row(*id).await? {
                    RowLock::Locked(r)
                        if r.status == Status::Pending
                            && (r.locked_at.is_none()
                                || inbox_order::lease_expired(&r, now, *lease_ttl))
                            && r.attempts_made == *attempts_made
                            && r.scheduled_at == *scheduled_at =>
                    {
                        Some(r)
                    }
                    _ => None,
                })
            }
            Guard::HeldBy { id, worker } => Ok(match self.lock_row(*id).await? {
                RowLock::Locked(r)
                    if r.status == Status::Pending
                        && r.locked_by.as_deref() == Some(worker.as_str()) =>
                {
                    Some(r)
                }
                _ => None,
            }),
        }
    }

    /// Reads the row undecoded: the guard on its raw status and lease, then the write, whose
    /// returned row is read for its state only (R106; Y-16).
    async fn fail_undecodable(
        &mut self,
        id: Uuid,
        worker: &WorkerId,
        error: &str,
        retry: Retry,
    ) -> Result<Option<WrittenState>, RepositoryError> {
        let s = self.stmts.clone();
        let held = self
            .c()
            .rows(&s.lock_row, &[Bind::Uuid(id)])
            .await?
            .into_iter()
            .next()
            .is_some_and(|r| {
                r.status == Status::Pending.as_str()
                    && r.locked_by.as_deref() == Some(worker.as_str())
            });
        if !held {
            return Ok(None);
        }
        let error = error.to_owned();
        let w = self
            .write_raw(id, &RowWrite::Counted { error, retry })
            .await?;
        let status = w.status.parse().map_err(|_| {
            RepositoryError::Other(format!(
                "inbox row {id}: status {:?} is not one of the three",
                w.status
            ))
        })?;
        Ok(Some(WrittenState {
            status,
            attempts_made: w.attempts_made,
            last_error: w.last_error,
            scheduled_at: w.scheduled_at,
        }))
    }

    async fn commit(self) -> Result<(), RepositoryError> {
        let table = self.stmts.table.clone();
        if self.faults.fail_next_commit.swap(false, Ordering::SeqCst) {
            let _ = D::rollback(&table, self.tx).await;
            return Err(RepositoryError::Unavailable {
                message: "injected failure of the commit (fail_next_row_commit)".into(),
            });
        }
        D::commit(&table, self.tx).await
    }

    async fn rollback(self) {
        let _ = D::rollback(&self.stmts.table, self.tx).await;
    }
}
