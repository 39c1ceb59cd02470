-- earlier (R145, R27): whether an earlier row of the inbox key (consumer_group, source,
-- partition_key) is in line, as this transaction sees the table: the fetch's `earlier` probe
-- (one LIMIT 1 descent of idx_<p>_pending_key_order) on the row given by its parameters.
-- Parameters: $1 text consumer_group, $2 text source, $3 text partition_key, $4 timestamptz
-- created_at, $5 uuid id of the row. Returns one row, one column `n int8` (1 or 0).
SELECT count(*)::int8 AS n
  FROM (SELECT $1::text AS consumer_group, $2::text AS source, $3::text AS partition_key,
               $4::timestamptz AS created_at, $5::uuid AS id) r
 CROSS JOIN LATERAL ({earlier:r}) x
