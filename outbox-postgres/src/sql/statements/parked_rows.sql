-- parked_rows (R192): the parked rows (pending with attempts_made >= max_attempts, R191) an
-- operator's redrive or discard selects, oldest first, row-locked for the write that follows
-- in the same transaction. The predicate is idx_<t>_parked's (R193).
-- Parameters: $1 uuid[] ids, $2 text[] topics, $3 text[] partition keys, each NULL for any.
-- Returns {columns} in write order (created_at, id).
SELECT {columns}
  FROM {table}
 WHERE status = 'pending' AND attempts_made >= max_attempts
   AND ($1::uuid[] IS NULL OR id = ANY($1::uuid[]))
   AND ($2::text[] IS NULL OR topic = ANY($2::text[]))
   AND ($3::text[] IS NULL OR partition_key = ANY($3::text[]))
 ORDER BY created_at, id
   FOR UPDATE
