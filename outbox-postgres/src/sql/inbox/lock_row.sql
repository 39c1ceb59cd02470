-- lock_row (R116 step 3, R152): the row's lock, not waited for.
-- Two forms: `lock_row_at` finds the row by the primary key of both layouts, `{at}` being
-- `AND created_at = $2::timestamptz` (the partitioned table's key is (created_at, id), and a
-- lookup by id alone reads every partition); `lock_row` by id alone (`{at}` empty), for a row
-- the transaction has not read decoded (R106: its created_at may be unreadable).
-- Parameters: $1 uuid id, ($2 timestamptz created_at). Returns {columns} of the row when this
-- transaction locked it; no row when another transaction holds its lock or it does not exist
-- (tell them apart with exists).
SELECT {columns} FROM {table} WHERE id = $1::uuid {at} FOR UPDATE SKIP LOCKED
