-- lock_rows (R152, R189): the locks of a processor transaction's rows at once, not waited for,
-- each row found by the primary key of both layouts (created_at, id) (see lock_row): ids are
-- unique, so `id = ANY … AND created_at = ANY …` selects exactly the pairs given, and reads the
-- primary key (or idx_<p>_created_at) of the partitions of those times only.
-- Parameters: $1 uuid[] ids, $2 timestamptz[] created_at, pairwise.
-- Returns {columns} of each row this transaction locked; a row another transaction holds, or
-- that does not exist, is not returned (the store checks R152's guard on each row returned).
SELECT {columns} FROM {table}
 WHERE id = ANY($1::uuid[]) AND created_at = ANY($2::timestamptz[])
   FOR UPDATE SKIP LOCKED
