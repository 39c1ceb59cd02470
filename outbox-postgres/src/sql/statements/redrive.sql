-- redrive (R192): R64 on parked rows: pending, attempts_made 0, last_error NULL, due now,
-- released. Each row is written only while it is still parked.
-- Parameters: $1 uuid[] ids (from parked_rows). Returns (id uuid, status text, attempts_made
-- int4, scheduled_at timestamptz) of the rows written.
UPDATE {table} t
   SET status = 'pending', attempts_made = 0, last_error = NULL, scheduled_at = now(),
       completed_at = NULL, locked_at = NULL, locked_by = NULL, updated_at = now()
 WHERE t.id = ANY($1::uuid[]) AND t.status = 'pending' AND t.attempts_made >= t.max_attempts
RETURNING t.id, t.status::text, t.attempts_made, t.scheduled_at
