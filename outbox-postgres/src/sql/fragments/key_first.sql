-- key_first: the first column of @'s key, the leading column of idx_<t>_pending_key_order: for
-- the outbox topic. The reads of a key's line order by it, then created_at (see `earlier`).
-- The inbox table supplies its own (src/sql/inbox/key_first.sql) through `expand_with`.
@.topic
