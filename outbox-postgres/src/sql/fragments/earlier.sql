-- earlier (R27): a probe for an in-line row of @'s key before @ in write order (created_at,
-- then id). Empty when @ is its key's head. One LIMIT 1 descent of idx_<t>_pending_key_order
-- (key and created_at in its index condition), whatever the backlog. The key is `same_key`,
-- the outbox's (topic, partition_key) or, for the inbox table, its own (see `expand_with`).
--
-- The ORDER BY (`key_first`, created_at) is there for the planner, whatever its statistics
-- (none, stale or fresh; custom or generic plans): that index alone yields this order, so
-- every other plan needs a sort. Without it, the inbox's group index idx_<p>_pending_group,
-- whose predicate the probe implies too, cost the same where the planner had no statistics
-- and was taken (it read all the group's pending rows per probe); ordered by created_at alone
-- (the key's columns plain equalities), idx_<t>_created_at yields the order too, and with fresh
-- statistics and a hot key the planner read that index from the oldest row on, though older
-- rows of other keys may lie first.
SELECT 1 AS found
  FROM {table} e
 WHERE {key_order:e} AND {same_key:@}
   AND e.created_at <= @.created_at AND (e.created_at < @.created_at OR e.id < @.id)
   AND {in_line:e}
 ORDER BY {key_first:e}, e.created_at
 LIMIT 1
