-- earlier (R27): a probe for an in-line row of @'s key before @ in write order (created_at,
-- then id). Empty when @ is its key's head. One LIMIT 1 descent of idx_<t>_pending_key_order
-- (key and created_at in its index condition), whatever the backlog. The key is `same_key`,
-- the outbox's (topic, partition_key) or, for the inbox table, its own (see `expand_with`).
SELECT 1 AS found
  FROM {table} e
 WHERE {key_order:e} AND {same_key:@}
   AND e.created_at <= @.created_at AND (e.created_at < @.created_at OR e.id < @.id)
   AND {in_line:e}
 LIMIT 1
