-- complete (R56): completion write for many rows, guarded by the lease holder (R54).
-- Parameters: $1 uuid[] ids, $2 text worker.
-- Returns (id uuid, status text, attempts_made int4, scheduled_at timestamptz) of the rows
-- written; ids not returned lost their lease (R55).
UPDATE {table} t
   SET status = 'completed', completed_at = now(), locked_at = NULL, locked_by = NULL,
       updated_at = now()
 WHERE t.id = ANY($1::uuid[]) AND t.status = 'pending' AND t.locked_by = $2::text
RETURNING t.id, t.status::text, t.attempts_made, t.scheduled_at
