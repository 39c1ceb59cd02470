//! The fetch (R76, R84): the heads statement from the walk cursor, then the take, in the
//! caller's transaction, a bounded number of times.

use outbox_core::repository::Fetched;

use crate::driver::outbox::{OutboxRows, fetch_heads_binds, fetch_take_binds};
use crate::sql::{self, FetchParams, HeadRows, Statements, Take, WalkCursor};

/// Runs the two fetch statements on `conn`, inside the caller's transaction: the heads
/// ([`Statements::fetch_heads`], from `cursor`, which it then advances), then the take
/// ([`Statements::take`]). Returns the taken rows in return order, each decoded or
/// [`Fetched::Undecodable`] (R82).
///
/// With [`Take::Transaction`] the heads statement runs inside
/// [`Statements::window_savepoint`] and the window's row locks are released
/// ([`Statements::window_release`]) before the take: the delivery transaction stays open for
/// the whole cycle and must hold only the rows it took. A take that finds every candidate
/// taken by another relay between the two statements looks again (a new snapshot), at most
/// [`sql::FETCH_ATTEMPTS`] times.
pub async fn fetch<C: OutboxRows + ?Sized>(
    conn: &mut C,
    stmts: &Statements,
    take: Take,
    worker: &str,
    p: &FetchParams,
    cursor: &WalkCursor,
) -> Result<Vec<Fetched>, C::Error> {
    let release_window = take == Take::Transaction;
    let take = stmts.take(take);
    for attempt in 1..=sql::FETCH_ATTEMPTS {
        if release_window {
            conn.execute(&stmts.window_savepoint, Vec::new()).await?;
        }
        let heads = conn
            .heads(&stmts.fetch_heads, fetch_heads_binds(p, cursor.get()))
            .await?;
        let heads = HeadRows::new(heads);
        cursor.advance(heads.walked_to);
        if release_window {
            conn.execute(&stmts.window_release, Vec::new()).await?;
        }
        if heads.ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = conn
            .fetched(take, fetch_take_binds(worker, p, heads.ids))
            .await?;
        if !rows.is_empty() || attempt == sql::FETCH_ATTEMPTS {
            return Ok(rows);
        }
    }
    Ok(Vec::new())
}
