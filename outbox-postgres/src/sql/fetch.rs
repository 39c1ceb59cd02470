//! The fetch's parameters, its walk cursor and its head rows.

use super::*;

/// How many of the oldest fetchable rows path A of the fetch reads (`$6` of
/// [`Statements::fetch_heads`]): twice the batch, at least 64, at most 4000. With rows of many
/// keys interleaved, the first 2 × batch fetchable rows hold about 2 × batch × (1 − batch /
/// keys) heads, enough whenever there are at least twice as many keys as the batch; otherwise
/// the key walk tops the batch up.
pub fn fetch_window(batch: usize) -> i64 {
    (batch.saturating_mul(2)).clamp(64, 4000) as i64
}

/// How many keys the key walk of [`Statements::fetch_heads`] visits at most (`$7`): four times
/// the batch, at least 64, at most 10,000. The walk stops earlier, after a batch of heads; this
/// bound only matters when most keys it meets are blocked, and the cursor carries the walk on
/// at the next fetch (R20).
pub fn fetch_walk_limit(batch: usize) -> i64 {
    (batch.saturating_mul(4)).clamp(64, 10_000) as i64
}

/// Which second statement a fetch runs: [`Statements::fetch_take`] (lease delivery, R76) or
/// [`Statements::fetch_take_transaction`] (delivery in one transaction, R84).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Stamp the lease.
    Lease,
    /// Keep the rows row-locked in the open delivery transaction.
    Transaction,
}

impl Statements {
    /// The text of the take statement for `take`.
    pub fn take(&self, take: Take) -> &str {
        match take {
            Take::Lease => &self.fetch_take,
            Take::Transaction => &self.fetch_take_transaction,
        }
    }
}

/// How many times a fetch runs its two statements when candidates were found but another relay
/// took every one of them between the two (each time with a new snapshot): an empty fetch
/// while due rows remain is what concurrent relays must avoid (R85), and the bound keeps the
/// fetch's work bounded by the batch.
pub const FETCH_ATTEMPTS: usize = 3;

/// The fetch parameters of a validated request, shared by both fetch statements.
#[derive(Debug, Clone, PartialEq)]
pub struct FetchParams {
    /// Batch size.
    pub limit: i64,
    /// Lease TTL in microseconds.
    pub lease_us: i64,
    /// max_per_key.
    pub max_per_key: i64,
    /// Topics filter.
    pub topics: Option<Vec<String>>,
    /// Aggregate types filter.
    pub aggregate_types: Option<Vec<String>>,
    /// Aggregate ids filter.
    pub aggregate_ids: Option<Vec<Uuid>>,
    /// Path A's window ([`fetch_window`]).
    pub window: i64,
    /// Path B's key bound ([`fetch_walk_limit`]).
    pub walk_limit: i64,
}

impl FetchParams {
    /// The parameters of a validated request.
    pub fn new(req: &FetchRequest) -> Self {
        Self {
            limit: req.limit.min(i64::MAX as usize) as i64,
            lease_us: micros(req.lease_ttl),
            max_per_key: req.max_per_key.min(i64::MAX as usize) as i64,
            topics: req.filter.topics.clone(),
            aggregate_types: req.filter.aggregate_types.clone(),
            aggregate_ids: req.filter.aggregate_ids.clone(),
            window: fetch_window(req.limit),
            walk_limit: fetch_walk_limit(req.limit),
        }
    }
}

/// Where the key walk of the next fetch starts (`$8`, `$9` of [`Statements::fetch_heads`]):
/// the last key the previous walk visited, so walk after walk goes round all keys (R20).
/// One per repository (clones share it); starts at the first key.
#[derive(Debug, Clone, Default)]
pub struct WalkCursor(std::sync::Arc<std::sync::Mutex<(String, String)>>);

impl WalkCursor {
    /// The (topic, partition_key) to bind; `("", "")` starts at the first key.
    pub fn get(&self) -> (String, String) {
        self.0.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Moves the cursor to the walk's last key, when the fetch walked.
    pub fn advance(&self, to: Option<(String, String)>) {
        if let (Some(to), Ok(mut c)) = (to, self.0.lock()) {
            *c = to;
        }
    }
}

/// The rows of [`Statements::fetch_heads`], read: the candidate heads in head order, to bind as
/// `$8` of [`Statements::fetch_take`], and the walk's last key, for [`WalkCursor::advance`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadRows {
    /// Candidate head ids in head order.
    pub ids: Vec<Uuid>,
    /// The last key the walk visited (None when path A alone answered).
    pub walked_to: Option<(String, String)>,
}

impl HeadRows {
    /// Reads `(head_id, topic, partition_key)` rows in the statement's order.
    pub fn new(rows: impl IntoIterator<Item = (Option<Uuid>, String, String)>) -> Self {
        let mut out = HeadRows::default();
        for (id, topic, key) in rows {
            match id {
                Some(id) => out.ids.push(id),
                None => out.walked_to = Some((topic, key)),
            }
        }
        out
    }
}

/// The parameters of [`Statements::blocked_keys`] in bind order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockedKeysParams {
    /// `$1` lease TTL in microseconds.
    pub lease_us: i64,
    /// `$2` limit.
    pub limit: i64,
    /// `$3` rows read from each candidate source: 4 × limit + 64, at most 100,000.
    pub candidates: i64,
    /// `$4` the waiting count stops here ([`txoutbox_core::repository::BLOCKED_WAITING_CAP`]).
    pub waiting_cap: i64,
}

impl BlockedKeysParams {
    /// The parameters for a lease TTL and a limit.
    pub fn new(lease_ttl: Duration, limit: usize) -> Self {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Self {
            lease_us: micros(lease_ttl),
            limit,
            candidates: limit.saturating_mul(4).saturating_add(64).min(100_000),
            waiting_cap: txoutbox_core::repository::BLOCKED_WAITING_CAP,
        }
    }
}
