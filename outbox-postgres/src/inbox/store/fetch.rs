//! The bounded fetch of the inbox store (R149, R150, R85): the window's heads, the key walk
//! past it, their runs, the batch chosen by the outbox's ordering rules, and the chosen rows
//! row-locked.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::inbox::InboxEvent;
use txoutbox_core::inbox::ordering as inbox_order;
use txoutbox_core::inbox::repository::InboxFetchRequest;
use txoutbox_core::ordering;
use txoutbox_core::repository::FetchFilter;
use uuid::Uuid;

use super::{Conn, views};
use crate::driver::inbox::{InboxRawRow, InboxRows};
use crate::driver::{Bind, Driver};
use crate::inbox::sql::InboxStatements;
use crate::sql::{WalkCursor, fetch_walk_limit, fetch_window, micros};

/// The fetch (R149, R150, R85), its parts run in the fetch's transaction; each returns the ids
/// to stamp, in return order (R22), every one row-locked by this transaction.
impl<D: Driver> Conn<'_, D>
where
    D::Conn: InboxRows,
{
    /// The bounded fetch: the heads of a window of the group's oldest fetchable rows
    /// (`fetch_heads`) and, when the window may have missed heads, those of a bounded key walk
    /// ([`walk_heads`](Self::walk_heads)), each keyed head's line after it up to what the batch can take
    /// (`fetch_runs`), the batch chosen by the outbox's rules ([`choose`]) over these rows, and
    /// the chosen run rows row-locked without waiting; a run is cut before a row another
    /// transaction holds (R28), and nothing past the batch is locked but the window. A head that
    /// does not decode is taken alone: it fails before its key's next row could run (R106). Its work
    /// is bounded by the batch: the window (twice the batch), at most a batch of LIMIT 1 probes,
    /// the walk's bounded descents, and a batch of line reads of at most max_per_key − 1 rows.
    pub(super) async fn fetch_windowed(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
        now: DateTime<Utc>,
        cursor: &WalkCursor,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let group = String::from(req.group.as_str());
        let mut heads = self
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
        if heads.len() < req.limit && req.key_order && self.window_overflows(s, req).await? {
            let more = self.walk_heads(s, req, now, &heads, cursor).await?;
            heads.extend(more);
        }
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
    async fn window_overflows(
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

    /// The heads past the window (the outbox fetch's path B for the inbox key, statement
    /// `fetch_walk`): a walk of the group's keyed lines from the store's cursor, one index
    /// descent per key, stopped after as many fetchable heads as the batch still wants or
    /// [`fetch_walk_limit`] keys, and the rows without partition_key (each a head) among the
    /// group's oldest unlocked fetchable rows, as many as the walk limit. The cursor moves to the
    /// walk's last key, so walk after walk goes round every key (R20). The candidates not
    /// already the window's heads are taken in head order, up to what the batch still wants, and
    /// row-locked without waiting: one held elsewhere is dropped (its key is held), and each
    /// taken row is judged again on its latest version. Work bounded by the batch, never by the
    /// backlog (R85).
    async fn walk_heads(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
        now: DateTime<Utc>,
        window_heads: &[InboxRawRow],
        cursor: &WalkCursor,
    ) -> Result<Vec<InboxRawRow>, RepositoryError> {
        let want = req.limit.saturating_sub(window_heads.len());
        let limit = fetch_walk_limit(req.limit);
        let (from_source, from_key) = cursor.get();
        let rows = self
            .rows(
                &s.fetch_walk,
                &[
                    Bind::Text(String::from(req.group.as_str())),
                    Bind::OptTexts(req.sources.clone()),
                    Bind::Int8(micros(req.lease_ttl)),
                    Bind::Int8(i64::try_from(want).unwrap_or(i64::MAX)),
                    Bind::Int8(limit),
                    Bind::Text(from_source),
                    Bind::Text(from_key),
                    Bind::Int8(limit),
                ],
            )
            .await?;
        cursor.advance(rows.iter().rev().find_map(|r| {
            r.partition_key
                .as_ref()
                .map(|k| (r.source.clone(), k.clone()))
        }));
        let known: HashSet<Uuid> = window_heads.iter().map(|h| h.id).collect();
        let head = |r: &InboxRawRow| {
            let v = r.clone().into_ordering_view();
            inbox_order::fetchable(&v, now, req.lease_ttl) && req.matches(&v)
        };
        let mut seen = HashSet::new();
        let mut candidates: Vec<InboxRawRow> = rows
            .into_iter()
            .filter(|r| !known.contains(&r.id) && seen.insert(r.id) && head(r))
            .collect();
        candidates.sort_by_key(|r| (r.scheduled_at, r.created_at, r.id));
        candidates.truncate(want);
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let order: Vec<Uuid> = candidates.iter().map(|r| r.id).collect();
        let mut locked: HashMap<Uuid, InboxRawRow> = self
            .rows(&s.try_lock, &[Bind::Uuids(order.clone())])
            .await?
            .into_iter()
            .map(|r| (r.id, r))
            .collect();
        Ok(order
            .iter()
            .filter_map(|id| locked.remove(id))
            .filter(|r| head(r))
            .collect())
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
