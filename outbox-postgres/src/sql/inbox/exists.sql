-- exists: whether a row is stored. Two forms as lock_row's: `exists_at` by the primary key
-- (`{at}` is `AND created_at = $2::timestamptz`), `exists` by id alone (`{at}` empty).
-- Parameters: $1 uuid id, ($2 timestamptz created_at). Returns one row, one column `n int8`
-- (1 or 0).
SELECT count(*)::int8 AS n FROM {table} WHERE id = $1::uuid {at}
