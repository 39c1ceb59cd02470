-- window_overflow (R85, R20): whether the group has more fetchable rows than the fetch's
-- window, so that a head may lie outside it. At most $4 + 1 rows of idx_<p>_pending_group, read
-- in its order (the ORDER BY keeps the planner on it when most of the table is not pending).
-- Parameters: $1 text consumer_group, $2 text[] sources (NULL for all), $3 int8 lease TTL in
-- microseconds, $4 int8 window. Returns one row, one column `n int8` (1 or 0).
SELECT (count(*) > $4::int8)::int4::int8 AS n FROM (
    SELECT 1
      FROM {table} u
     WHERE u.consumer_group = $1::text AND {key_order:u} AND {due:u}
       AND ($2::text[] IS NULL OR u.source = ANY($2::text[]))
     ORDER BY u.scheduled_at
     LIMIT $4::int8 + 1
) x
