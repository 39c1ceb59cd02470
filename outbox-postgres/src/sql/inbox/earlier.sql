-- earlier (R145, R27): whether an earlier row of the inbox key (consumer_group, source,
-- partition_key) is in line, as this transaction sees the table. One LIMIT 1 descent of
-- idx_<p>_pending_key_order.
-- Parameters: $1 text consumer_group, $2 text source, $3 text partition_key, $4 timestamptz
-- created_at, $5 uuid id of the row. Returns one row, one column int8 (1 or 0).
SELECT count(*)::int8 FROM (
    SELECT 1
      FROM {table} e
     WHERE {key_order:e} AND e.consumer_group = $1::text AND e.source = $2::text
       AND e.partition_key = $3::text
       AND e.created_at <= $4::timestamptz AND (e.created_at < $4::timestamptz OR e.id < $5::uuid)
       AND {in_line:e}
     LIMIT 1
) x
