-- release (R77): hand rows back untouched, guarded by the lease holder.
-- Parameters: $1 uuid[] ids, $2 text worker.
-- Returns (id uuid, status text, attempts_made int4, scheduled_at timestamptz) of the rows
-- released.
UPDATE {table} t
   SET locked_at = NULL, locked_by = NULL, updated_at = now()
 WHERE t.id = ANY($1::uuid[]) AND {pending:t} AND t.locked_by = $2::text
RETURNING t.id, t.status::text, t.attempts_made, t.scheduled_at
