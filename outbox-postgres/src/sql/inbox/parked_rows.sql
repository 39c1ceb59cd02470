-- parked_rows (R192): the parked rows (pending with attempts_made >= max_attempts, R191) of a
-- consumer group that an operator's redrive or discard selects, oldest first, row-locked for the
-- write that follows in the same transaction. The predicate is idx_<p>_parked's (R193).
-- Parameters: $1 text consumer_group, $2 uuid[] ids, $3 text[] sources, $4 text[] partition
-- keys, each array NULL for any. Returns {columns} in write order (created_at, id).
SELECT {columns}
  FROM {table}
 WHERE status = 'pending' AND attempts_made >= max_attempts AND consumer_group = $1::text
   AND ($2::uuid[] IS NULL OR id = ANY($2::uuid[]))
   AND ($3::text[] IS NULL OR source = ANY($3::text[]))
   AND ($4::text[] IS NULL OR partition_key = ANY($4::text[]))
 ORDER BY created_at, id
   FOR UPDATE
