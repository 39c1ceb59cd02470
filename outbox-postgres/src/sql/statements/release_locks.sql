-- release_locks (R24), bulk. Parameters: $1 uuid[] ids, $2 text worker.
-- Affects the rows the worker holds; run it in a transaction and roll back when the count
-- differs from the number of ids.
UPDATE {table} t SET locked_at = NULL, locked_by = NULL, updated_at = now()
 WHERE t.id = ANY($1::uuid[]) AND {pending:t} AND t.locked_by = $2::text
