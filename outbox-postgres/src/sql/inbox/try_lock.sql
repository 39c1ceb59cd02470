-- try_lock (R149): row-locks those of the given rows no other transaction holds the lock of.
-- Parameters: $1 uuid[] ids. Returns {columns} of the rows locked.
SELECT {columns} FROM {table} WHERE id = ANY($1::uuid[]) FOR UPDATE SKIP LOCKED
