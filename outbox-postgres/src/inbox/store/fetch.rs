//! The bounded fetch of the inbox store (R149, R150, R85): the window's heads, their runs, the
//! batch chosen by the outbox's ordering rules, and the chosen rows row-locked; the whole-line
//! read for the case the window cannot serve.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use outbox_core::error::RepositoryError;
use outbox_core::inbox::InboxEvent;
use outbox_core::inbox::ordering as inbox_order;
use outbox_core::inbox::repository::InboxFetchRequest;
use outbox_core::ordering;
use outbox_core::repository::FetchFilter;
use uuid::Uuid;

use super::{Conn, views};
use crate::driver::inbox::InboxRows;
use crate::driver::{Bind, Driver};
use crate::inbox::sql::InboxStatements;
use crate::sql::{fetch_window, micros};

/// The fetch (R149, R150, R85), its parts run in the fetch's transaction; each returns the ids
/// to stamp, in return order (R22), every one row-locked by this transaction.
impl<D: Driver> Conn<'_, D>
where
    D::Conn: InboxRows,
{
    /// The bounded fetch: the heads of a window of the group's oldest fetchable rows
    /// (`fetch_heads`), each keyed head's line after it up to what the batch can take
    /// (`fetch_runs`), the batch chosen by the outbox's rules ([`choose`]) over these rows, and
    /// the chosen run rows row-locked without waiting; a run is cut before a row another
    /// transaction holds (R28), and nothing past the batch is locked but the window. A head that
    /// does not decode is taken alone: it fails before its key's next row could run (R106). Its work
    /// is bounded by the batch: the window (twice the batch), at most a batch of LIMIT 1 probes
    /// and a batch of line reads of at most max_per_key − 1 rows.
    pub(super) async fn fetch_windowed(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
        now: DateTime<Utc>,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let group = String::from(req.group.as_str());
        let heads = self
            .rows(
                &s.fetch_heads,
                &[
                    Bind::Text(group.clone()),
                    Bind::OptTexts(req.sources.clone()),
                    Bind::Int8(micros(req.lease_ttl)),
                    Bind::Int4(i32::from(req.key_order)),
                    Bind::Int8(i64::try_from(req.limit).unwrap_or(i64::MAX)),
                    Bind::Int8(fetch_window(req.limit)),
                ],
            )
            .await?;
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        let undecodable: HashSet<Uuid> = heads
            .iter()
            .filter(|h| h.problem().is_some())
            .map(|h| h.id)
            .collect();
        let heads = views(heads);
        let head_ids: HashSet<Uuid> = heads.iter().map(|h| h.id).collect();
        let keyed: Vec<&InboxEvent> = heads
            .iter()
            .filter(|h| req.key_order && h.partition_key.is_some() && !undecodable.contains(&h.id))
            .collect();
        let per_key = (req.max_per_key.max(1) - 1).min(req.limit.saturating_sub(heads.len()));
        let mut rows = heads.clone();
        if per_key > 0 && !keyed.is_empty() {
            rows.extend(views(
                self.rows(
                    &s.fetch_runs,
                    &[
                        Bind::Text(group),
                        Bind::Texts(keyed.iter().map(|h| h.source.clone()).collect()),
                        Bind::Texts(
                            keyed
                                .iter()
                                .map(|h| h.partition_key.clone().unwrap_or_default())
                                .collect(),
                        ),
                        Bind::NullableTimestamps(
                            keyed.iter().map(|h| Some(h.created_at)).collect(),
                        ),
                        Bind::Uuids(keyed.iter().map(|h| h.id).collect()),
                        Bind::Int8(i64::try_from(per_key).unwrap_or(i64::MAX)),
                    ],
                )
                .await?,
            ));
        }
        let ids = choose(&rows, now, req);
        let run_ids: Vec<Uuid> = ids
            .iter()
            .filter(|id| !head_ids.contains(id))
            .copied()
            .collect();
        if run_ids.is_empty() {
            return Ok(ids);
        }
        let locked: HashSet<Uuid> = self
            .rows(&s.try_lock, &[Bind::Uuids(run_ids.clone())])
            .await?
            .into_iter()
            .map(|r| r.id)
            .collect();
        if locked.len() == run_ids.len() {
            return Ok(ids);
        }
        mark_held(&mut rows, &run_ids, &locked, now);
        // Runs cut before the rows held elsewhere; a run the cut would lengthen beyond what was
        // locked keeps what was locked (a prefix of it).
        Ok(choose(&rows, now, req)
            .into_iter()
            .filter(|id| head_ids.contains(id) || locked.contains(id))
            .collect())
    }

    /// Whether the group has more fetchable rows than the window read: only then can a head
    /// lie outside it (R20).
    pub(super) async fn window_overflows(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
    ) -> Result<bool, RepositoryError> {
        let n = self
            .int8(
                &s.window_overflow,
                &[
                    Bind::Text(String::from(req.group.as_str())),
                    Bind::OptTexts(req.sources.clone()),
                    Bind::Int8(micros(req.lease_ttl)),
                    Bind::Int8(fetch_window(req.limit)),
                ],
            )
            .await?;
        Ok(n == Some(1))
    }

    /// The whole-line fetch, when the window may have missed heads (it is full of rows queued
    /// behind blocked heads, or of a few long lines): every in-line row of the group is read and
    /// every fetchable one row-locked without waiting (one held elsewhere holds its key), then
    /// the batch chosen. Its work grows with the group's in-line rows; a bounded key walk (the
    /// outbox fetch's path B) is not carried over yet.
    pub(super) async fn fetch_whole_lines(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
        now: DateTime<Utc>,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let binds = [
            Bind::Text(String::from(req.group.as_str())),
            Bind::OptTexts(req.sources.clone()),
        ];
        let mut rows = views(self.rows(&s.in_line_rows, &binds).await?);
        let fetchable: Vec<Uuid> = rows
            .iter()
            .filter(|r| inbox_order::fetchable(r, now, req.lease_ttl))
            .map(|r| r.id)
            .collect();
        if fetchable.is_empty() {
            return Ok(Vec::new());
        }
        let locked: HashSet<Uuid> = self
            .rows(&s.try_lock, &[Bind::Uuids(fetchable.clone())])
            .await?
            .into_iter()
            .map(|r| r.id)
            .collect();
        mark_held(&mut rows, &fetchable, &locked, now);
        Ok(choose(&rows, now, req))
    }
}

/// Marks the rows of `tried` that this transaction could not row-lock as held (in line for
/// their key, not fetchable), so that [`choose`] skips them and cuts their runs.
fn mark_held(rows: &mut [InboxEvent], tried: &[Uuid], locked: &HashSet<Uuid>, now: DateTime<Utc>) {
    for r in rows.iter_mut() {
        if tried.contains(&r.id) && !locked.contains(&r.id) {
            r.locked_at = Some(now);
            r.locked_by = Some("(row-locked)".into());
        }
    }
}

/// The outbox view of the rows, chosen by the outbox's rules (R149, R150).
fn choose(rows: &[InboxEvent], now: DateTime<Utc>, req: &InboxFetchRequest) -> Vec<Uuid> {
    let views: Vec<_> = rows
        .iter()
        .map(|r| inbox_order::view(r, req.key_order))
        .collect();
    ordering::select(
        views.iter(),
        now,
        req.limit,
        req.lease_ttl,
        req.max_per_key,
        &FetchFilter::none(),
    )
    .into_iter()
    .map(|v| v.id)
    .collect()
}
