-- release_stale_locks (R63), one batch. Parameters: $1 int8 timeout in microseconds,
-- $2 int8 batch size. Releases up to $2 pending rows locked before now() - timeout, skipping
-- row-locked rows. Affected-row count = rows released; repeat while it equals $2 (at most
-- 1000 times).
WITH s AS (
    SELECT id FROM {table}
     WHERE locked_at < now() - $1::int8 * INTERVAL '1 microsecond' AND status = 'pending'
     ORDER BY locked_at
     LIMIT $2::int8
       FOR UPDATE SKIP LOCKED
)
UPDATE {table} t SET locked_at = NULL, locked_by = NULL, updated_at = now()
  FROM s WHERE t.id = s.id
