-- discard (R192): parked rows become 'failed', released, with their new last_error
-- (`discarded: {reason}; ` + the old one, cut as R9, computed by the caller). Each row is
-- written only while it is still parked.
-- Parameters: $1 uuid[] ids, $2 text[] last_error, one per id. Returns (id uuid, status text,
-- attempts_made int4, scheduled_at timestamptz) of the rows written.
UPDATE {table} t
   SET status = 'failed', last_error = o.error, locked_at = NULL, locked_by = NULL,
       updated_at = now()
  FROM unnest($1::uuid[], $2::text[]) AS o(id, error)
 WHERE t.id = o.id AND t.status = 'pending' AND t.attempts_made >= t.max_attempts
RETURNING t.id, t.status::text, t.attempts_made, t.scheduled_at
