-- release_stale_locks (R63), one batch. Parameters: $1 int8 timeout in microseconds,
-- $2 int8 batch size. Releases up to $2 pending rows locked before now() - timeout, skipping
-- row-locked rows. Affected-row count = rows released; repeat while it equals $2 (at most
-- 1000 times). The rows are found through idx_<t>_locked_at and written by id through the
-- primary key (`= ANY(ARRAY(...))`, never a join the planner could turn into a table scan).
WITH s AS (
    SELECT l.id FROM {table} l
     WHERE l.locked_at < now() - $1::int8 * INTERVAL '1 microsecond' AND {pending:l}
     ORDER BY l.locked_at
     LIMIT $2::int8
       FOR UPDATE SKIP LOCKED
)
UPDATE {table} t SET locked_at = NULL, locked_by = NULL, updated_at = now()
 WHERE t.id = ANY(ARRAY(SELECT s.id FROM s))
