-- complete (R56): completion write for many rows, guarded by the lease holder (R54).
-- Parameters: $1 uuid[] ids, $2 text worker.
-- {holder}: lease delivery guards each row by its holder (t.locked_by = $2); delivery in one
-- transaction (R84) by the row lock it already holds ($2 unused but typed).
-- Returns (id uuid, status text, attempts_made int4, scheduled_at timestamptz) of the rows
-- written; ids not returned lost their lease (R55).
UPDATE {table} t
   SET status = 'completed', completed_at = now(), locked_at = NULL, locked_by = NULL,
       updated_at = now()
 WHERE t.id = ANY($1::uuid[]) AND {pending:t} AND {holder}
RETURNING t.id, t.status::text, t.attempts_made, t.scheduled_at
