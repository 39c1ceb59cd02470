-- delete_old_completed (R65), one round. Parameters: $1 int4 retention days, $2 int8 batch
-- size. Affected-row count = rows deleted. Only completed rows are ever deleted. The rows are
-- found through idx_<t>_completed_cleanup and deleted by id through the primary key.
DELETE FROM {table} t WHERE t.id = ANY(ARRAY(
    SELECT c.id FROM {table} c
     WHERE c.status = 'completed' AND c.completed_at IS NOT NULL
       AND c.completed_at < now() - $1::int4 * INTERVAL '1 day'
     ORDER BY c.completed_at
     LIMIT $2::int8
       FOR UPDATE SKIP LOCKED))
