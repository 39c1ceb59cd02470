-- earlier (R27): a probe for an in-line row of @'s key before @ in write order (created_at,
-- then id). Empty when @ is its key's head. One LIMIT 1 descent of idx_<t>_pending_key_order,
-- whatever the backlog. The key is `key` and `same_key`, the outbox's (topic, partition_key)
-- or, for the inbox table, its own (see `expand_with`).
--
-- Written so that this index is the only plan the planner can like, whatever its statistics
-- (none, stale or fresh; custom or generic plans):
--
-- * the ORDER BY is the index's own order, which no other index yields: the inbox's group
--   index idx_<p>_pending_group also matches the probe, and where the planner has no
--   statistics it costs both scans alike, so that without the order it took the group index
--   and read all the group's pending rows per probe;
-- * the key is `same_key`'s inequalities, not equalities, so that this order does not shrink
--   to created_at, which idx_<t>_created_at also yields (with fresh statistics and a hot key
--   the planner read that index from the oldest row on, though older rows of other keys and
--   completed ones may lie first);
-- * the two row comparisons on the index's leading columns position the descent at the key's
--   first row and stop it at @ (the inequalities alone would read the group from its start).
SELECT 1 AS found
  FROM {table} e
 WHERE {key_order:e} AND {same_key:@}
   AND ({key:e}) >= ({key:@})
   AND ({key:e}, e.created_at) <= ({key:@}, @.created_at)
   AND (e.created_at < @.created_at OR e.id < @.id)
   AND {in_line:e}
 ORDER BY {key:e}, e.created_at
 LIMIT 1
