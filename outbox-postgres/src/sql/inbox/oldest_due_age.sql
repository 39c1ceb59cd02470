-- oldest_due_age (R161): now() minus the scheduled_at of the group's oldest due pending row.
-- Parameters: $1 text consumer_group. Returns one row, one column int8 (microseconds), NULL
-- when no pending row of the group is due. Reads idx_<p>_pending_group.
SELECT (EXTRACT(EPOCH FROM (now() - min(t.scheduled_at))) * 1000000)::int8
  FROM {table} t
 WHERE t.consumer_group = $1::text AND t.status = 'pending' AND t.scheduled_at <= now()
