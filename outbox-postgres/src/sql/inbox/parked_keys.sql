-- parked_keys (R193's gauge inbox_parked_keys): the keys of a consumer group with a parked row,
-- read from idx_<p>_parked. Parameters: $1 text consumer_group. Returns one row, one column
-- `n int8`.
SELECT count(DISTINCT (source, partition_key))::int8 AS n
  FROM {table}
 WHERE status = 'pending' AND attempts_made >= max_attempts AND consumer_group = $1::text
   AND partition_key IS NOT NULL
