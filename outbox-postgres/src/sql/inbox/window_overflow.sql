-- window_overflow (R85, R20): whether the group has more fetchable rows than the fetch's
-- window, so that a head may lie outside it. The window's two ranges (fetch_heads), each read
-- in its index's order and stopped at $4 + 1 rows: the group has more than $4 fetchable rows
-- exactly when the two capped counts add up to more than $4.
-- Parameters: $1 text consumer_group, $2 text[] sources (NULL for all), $3 int8 lease TTL in
-- microseconds, $4 int8 window. Returns one row, one column `n int8` (1 or 0).
SELECT ((SELECT count(*) FROM (
             SELECT 1 FROM {table} u
              WHERE {window_unlocked:u}
              ORDER BY u.scheduled_at, u.created_at, u.id
              LIMIT $4::int8 + 1) a)
        + (SELECT count(*) FROM (
             SELECT 1 FROM {table} x
              WHERE {window_expired:x}
              ORDER BY x.scheduled_at, x.created_at, x.id
              LIMIT $4::int8 + 1) b)
        > $4::int8)::int4::int8 AS n
