-- delete_old_completed (R65), one round. Parameters: $1 int4 retention days, $2 int8 batch
-- size. Affected-row count = rows deleted. Only completed rows are ever deleted.
DELETE FROM {table} WHERE id IN (
    SELECT id FROM {table}
     WHERE status = 'completed' AND completed_at IS NOT NULL
       AND completed_at < now() - $1::int4 * INTERVAL '1 day'
     ORDER BY completed_at
     LIMIT $2::int8
       FOR UPDATE SKIP LOCKED)
