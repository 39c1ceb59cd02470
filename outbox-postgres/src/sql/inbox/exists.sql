-- exists: whether a row is stored. Parameters: $1 uuid id. Returns one row, one column int8
-- (1 or 0).
SELECT count(*)::int8 FROM {table} WHERE id = $1::uuid
