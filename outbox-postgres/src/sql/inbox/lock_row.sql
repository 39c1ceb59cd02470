-- lock_row (R116 step 3, R152): the row's lock, not waited for.
-- Parameters: $1 uuid id. Returns {columns} of the row when this transaction locked it; no row
-- when another transaction holds its lock or it does not exist (tell them apart with exists).
SELECT {columns} FROM {table} WHERE id = $1::uuid FOR UPDATE SKIP LOCKED
