-- waiting (R161): pending rows behind a key's head, counted up to a cap.
-- Parameters: $1 text consumer_group, $2 text source, $3 text partition_key, $4 timestamptz
-- the head's created_at, $5 uuid the head's id, $6 int8 the cap. Returns one row, one column `n int8`.
-- One read of idx_<p>_pending_key_order in its order, at most $6 rows, written like the
-- `earlier` probe (see it) so that no other index can serve it whatever the statistics.
SELECT count(*)::int8 AS n
  FROM (SELECT $1::text AS consumer_group, $2::text AS source, $3::text AS partition_key,
               $4::timestamptz AS created_at, $5::uuid AS id) r
 CROSS JOIN LATERAL (
       SELECT 1
         FROM {table} e
        WHERE {key_order:e} AND {same_key:r}
          AND e.created_at >= r.created_at AND (e.created_at > r.created_at OR e.id > r.id)
        ORDER BY {key_first:e}, e.created_at
        LIMIT $6::int8
 ) x
