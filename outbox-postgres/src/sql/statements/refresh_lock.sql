-- refresh_lock (R24). Parameters: $1 uuid id, $2 text worker.
-- Affects 1 row when the worker holds it, else 0.
UPDATE {table} t SET locked_at = now(), updated_at = now()
 WHERE t.id = $1::uuid AND {pending:t} AND t.locked_by = $2::text
