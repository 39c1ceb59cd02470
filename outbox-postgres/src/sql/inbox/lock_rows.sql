-- lock_rows (R152, R189): the locks of a processor transaction's rows at once, not waited for,
-- each row found by the primary key of both layouts (created_at, id) (see lock_row).
-- Parameters: $1 uuid[] ids, $2 timestamptz[] created_at, pairwise.
-- Returns {columns} of each row this transaction locked; a row another transaction holds, or
-- that does not exist, is not returned (the store checks R152's guard on each row returned).
SELECT {columns} FROM {table}
 WHERE (id, created_at) IN (SELECT u.id, u.created_at
                              FROM unnest($1::uuid[], $2::timestamptz[]) AS u(id, created_at))
   FOR UPDATE SKIP LOCKED
