-- pending: a pending row, for every read that must not use a partial index: the lookups by id
-- (the take's locks, the lease stamp, the outcome writes) and the reads of leased rows.
-- Compared under the "C" collation, which for these ASCII values is the same equality as the
-- column's collation, so that it implies the predicate of no partial index of the table: the
-- planner cannot choose idx_<t>_pending_key_order or idx_<t>_pending_fetch, whose size is the
-- backlog, over the primary key (or idx_<t>_locked_at), whatever its statistics say.
@.status COLLATE "C" = 'pending'
