-- parked_stats (R193's gauges): the parked keys and rows (keyless rows included) of a
-- consumer group, read from idx_<p>_parked. Parameters: $1 text consumer_group. Returns {columns}
-- of nothing: one row, one column `n int8` per statement: this one counts the parked rows.
SELECT count(*)::int8 AS n
  FROM {table}
 WHERE status = 'pending' AND attempts_made >= max_attempts AND consumer_group = $1::text
