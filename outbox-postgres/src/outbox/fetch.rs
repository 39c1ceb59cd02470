//! The fetch (R76, R84): the heads statement from the walk cursor, then the take, a bounded
//! number of times.

use txoutbox_core::repository::Fetched;
use uuid::Uuid;

use crate::driver::Bind;
use crate::driver::outbox::{OutboxRows, fetch_heads_binds, fetch_take_binds};
use crate::sql::{self, FetchParams, HeadRows, Statements, Take, WalkCursor};

/// Runs a heads statement on `conn` from `cursor` (which it then advances) and returns the
/// candidate heads in head order: `text` is [`Statements::fetch_heads`] inside the lease
/// fetch's transaction, or [`Statements::fetch_heads_autocommit`] in autocommit (transaction
/// delivery: its own transaction, so its window's row locks end with it, before the take,
/// which checks every candidate again).
pub async fn heads<C: OutboxRows + ?Sized>(
    conn: &mut C,
    text: &str,
    p: &FetchParams,
    cursor: &WalkCursor,
) -> Result<Vec<Uuid>, C::Error> {
    let heads = conn.heads(text, fetch_heads_binds(p, cursor.get())).await?;
    let heads = HeadRows::new(heads);
    cursor.advance(heads.walked_to);
    Ok(heads.ids)
}

/// The take ([`Statements::take`]) of the candidate heads `ids` on `conn`: the taken rows in
/// return order, each decoded or [`Fetched::Undecodable`] (R82). With [`Take::Transaction`],
/// `timeout_ms` (the delivery's server-side idle bound, R84) is bound as its `$9`; the lease
/// take has no `$9`.
pub async fn take<C: OutboxRows + ?Sized>(
    conn: &mut C,
    stmts: &Statements,
    take: Take,
    worker: &str,
    p: &FetchParams,
    ids: Vec<Uuid>,
    timeout_ms: Option<String>,
) -> Result<Vec<Fetched>, C::Error> {
    let mut binds = fetch_take_binds(worker, p, ids);
    if let (Take::Transaction, Some(t)) = (take, timeout_ms) {
        binds.push(Bind::Text(t));
    }
    conn.fetched(stmts.take(take), binds).await
}

/// The lease fetch (R76) on `conn`, inside the caller's fetch transaction (commit it right
/// after): [`Statements::fetch_heads`], then the lease take. A take that finds every candidate
/// taken by another relay between the two statements looks again (a new snapshot), at most
/// [`sql::FETCH_ATTEMPTS`] times.
pub async fn fetch<C: OutboxRows + ?Sized>(
    conn: &mut C,
    stmts: &Statements,
    worker: &str,
    p: &FetchParams,
    cursor: &WalkCursor,
) -> Result<Vec<Fetched>, C::Error> {
    for attempt in 1..=sql::FETCH_ATTEMPTS {
        let ids = heads(conn, &stmts.fetch_heads, p, cursor).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = take(conn, stmts, Take::Lease, worker, p, ids, None).await?;
        if !rows.is_empty() || attempt == sql::FETCH_ATTEMPTS {
            return Ok(rows);
        }
    }
    Ok(Vec::new())
}
