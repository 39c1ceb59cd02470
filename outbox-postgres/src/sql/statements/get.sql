-- get: one row by id.
-- Parameters: $1 uuid id. Returns {columns} (0 or 1 row).
SELECT {columns} FROM {table} WHERE id = $1::uuid
