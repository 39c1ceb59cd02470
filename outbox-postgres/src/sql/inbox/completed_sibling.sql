-- completed_sibling (R164): whether another row of the dedup key is completed (the
-- partitioned table only; take dedup_lock first).
-- Parameters: $1 text message_id, $2 text consumer_group, $3 uuid id of the row. Returns one
-- row, one column int8 (1 or 0).
SELECT count(*)::int8 FROM (
    SELECT 1 FROM {table}
     WHERE message_id = $1::text AND consumer_group = $2::text AND id <> $3::uuid
       AND status = 'completed'
     LIMIT 1
) x
