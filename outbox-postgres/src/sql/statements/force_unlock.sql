-- force_unlock (R66). Parameters: $1 uuid id, $2 text last_error ('Force unlock: ...').
-- Affects 1 row when the row was held, else 0 (then report "not locked").
UPDATE {table} SET locked_at = NULL, locked_by = NULL, last_error = $2::text, updated_at = now()
 WHERE id = $1::uuid AND locked_at IS NOT NULL
