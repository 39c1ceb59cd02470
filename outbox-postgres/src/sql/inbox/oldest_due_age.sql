-- oldest_due_age (R161): now() minus the scheduled_at of the group's oldest due pending row.
-- Parameters: $1 text consumer_group. Returns one row, one column `n int8` (microseconds), NULL
-- when no pending row of the group is due. One row of idx_<p>_pending_group, read in its order:
-- written as ORDER BY ... LIMIT 1 rather than min(), which the planner, where it has no
-- statistics, computed over the group's whole backlog.
SELECT (EXTRACT(EPOCH FROM (now() - (
           SELECT t.scheduled_at
             FROM {table} t
            WHERE t.consumer_group = $1::text AND t.status = 'pending' AND t.scheduled_at <= now()
            ORDER BY t.scheduled_at
            LIMIT 1))) * 1000000)::int8 AS n
