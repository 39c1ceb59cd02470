-- waiting (R161): pending rows behind a key's head, counted up to a cap.
-- Parameters: $1 text consumer_group, $2 text source, $3 text partition_key, $4 timestamptz
-- the head's created_at, $5 uuid the head's id, $6 int8 the cap. Returns one row, one int8.
SELECT count(*)::int8 FROM (
    SELECT 1
      FROM {table} e
     WHERE {key_order:e} AND e.consumer_group = $1::text AND e.source = $2::text
       AND e.partition_key = $3::text
       AND e.created_at >= $4::timestamptz AND (e.created_at > $4::timestamptz OR e.id > $5::uuid)
     LIMIT $6::int8
) x
