-- by_message_id (R111, R112): the row of a dedup key a landing returns: the completed one if
-- any, else the earliest by write order (created_at, id). One row on the plain table, where
-- the unique index holds one row per dedup key.
-- Parameters: $1 text message_id, $2 text consumer_group. Returns {columns} (0 or 1 row).
SELECT {columns}
  FROM {table}
 WHERE message_id = $1::text AND consumer_group = $2::text
 ORDER BY (status = 'completed') DESC, created_at, id
 LIMIT 1
