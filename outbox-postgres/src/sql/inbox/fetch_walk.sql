-- fetch_walk (R149, R150, R20, R85): the heads a fetch finds past its window, by a bounded walk
-- of the group's keys: the outbox fetch's path B (src/sql/statements/fetch_heads.sql, `walk`)
-- for the inbox key. Run in the fetch's transaction after fetch_heads, only when the window
-- handed out fewer heads than the batch while the group has more fetchable rows than the window
-- (window_overflow): a window full of rows queued behind blocked heads, or of a few long lines.
--
-- Parameters:
--   $1 text    consumer_group
--   $2 text[]  sources, or NULL for all
--   $3 int8    lease TTL in microseconds (a lease older than that has expired)
--   $4 int8    heads wanted (>= 1): the walk stops after this many fetchable heads
--   $5 int8    walk limit: how many keys the walk visits at most
--   $6 text    walk cursor, source: the walk starts at the first key >= ($6, $7)
--   $7 text    walk cursor, partition key ('' and '' start at the first key)
--   $8 int8    how many of the group's oldest unlocked fetchable rows the read of rows without
--              partition_key passes over (the window and as far again)
--
-- Returns {columns} of: first the rows without partition_key among the $8 oldest unlocked
-- fetchable rows of the group (each a key of its own and so a head, R150), in head order; then
-- the walk's rows in walk order: each visited key's first in-line row that is fetchable and of
-- the sources, and the last key's first in-line row whatever it is (the caller's next cursor,
-- its (source, partition_key)). Nothing is locked here: the store row-locks the heads it takes
-- with try_lock (SKIP LOCKED) and drops those held elsewhere.
--
-- The walk visits keyed lines (partition_key not null) of the group in (source, partition_key)
-- order from the cursor, wrapping around once, reading each key's first in-line row in one
-- descent of idx_<p>_pending_key_order (the group in its index condition, (source,
-- partition_key) a row comparison on its next two columns; the order (source, partition_key,
-- created_at) only that index yields), and stops after $4 fetchable heads or $5 keys: its cost
-- is bounded by the batch, never by the backlog or the number of keys (R85), and the cursor
-- brings every key's turn within a bounded number of fetches (R20). The rows without
-- partition_key are one read of idx_<p>_pending_window in its order, stopped at $8 rows: a row
-- without a key deeper than that in a blocked backlog waits until the window moves.
WITH RECURSIVE
walk AS (
    SELECT 1 AS depth, f.*, o.ok, o.ok::int AS found
      FROM (
           (SELECT s.*, false AS wrapped FROM (
                SELECT {t_columns}
                  FROM {table} t
                 WHERE {key_order:t} AND t.partition_key IS NOT NULL
                   AND t.consumer_group = $1::text
                   AND (t.source, t.partition_key) >= ($6::text, $7::text)
                   AND {in_line:t}
                 ORDER BY t.consumer_group, t.source, t.partition_key, t.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           UNION ALL
           (SELECT s.*, true AS wrapped FROM (
                SELECT {t_columns}
                  FROM {table} t
                 WHERE {key_order:t} AND t.partition_key IS NOT NULL
                   AND t.consumer_group = $1::text
                   AND {in_line:t}
                 ORDER BY t.consumer_group, t.source, t.partition_key, t.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           LIMIT 1
      ) f
     CROSS JOIN LATERAL (
           SELECT {due:f} AND ($2::text[] IS NULL OR f.source = ANY($2::text[])) AS ok
     ) o
    UNION ALL
    SELECT p.depth + 1, n.*, o.ok, p.found + o.ok::int
      FROM walk p
     CROSS JOIN LATERAL (
           (SELECT s.*, p.wrapped AS wrapped FROM (
                SELECT {t_columns}
                  FROM {table} t
                 WHERE {key_order:t} AND t.partition_key IS NOT NULL
                   AND t.consumer_group = $1::text
                   AND (t.source, t.partition_key) > (p.source, p.partition_key)
                   AND {in_line:t}
                 ORDER BY t.consumer_group, t.source, t.partition_key, t.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           UNION ALL
           (SELECT s.*, true AS wrapped FROM (
                SELECT {t_columns}
                  FROM {table} t
                 WHERE {key_order:t} AND t.partition_key IS NOT NULL AND NOT p.wrapped
                   AND t.consumer_group = $1::text
                   AND {in_line:t}
                 ORDER BY t.consumer_group, t.source, t.partition_key, t.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           LIMIT 1
     ) n
     CROSS JOIN LATERAL (
           SELECT {due:n} AND ($2::text[] IS NULL OR n.source = ANY($2::text[])) AS ok
     ) o
     WHERE p.depth < $5::int8 AND p.found < $4::int8
       AND NOT (n.wrapped AND (n.source, n.partition_key) >= ($6::text, $7::text))
),
loose AS (
    SELECT t.*
      FROM (SELECT {t_columns}
              FROM {table} t
             WHERE {window_unlocked:t}
             ORDER BY t.scheduled_at, t.created_at, t.id
             LIMIT $8::int8) t
     WHERE t.partition_key IS NULL
)
SELECT {t_columns}
  FROM (SELECT {t_columns}, 0 AS part, 0 AS depth FROM loose t
        UNION ALL
        SELECT {t_columns}, 1 AS part, t.depth
          FROM walk t
         WHERE t.ok OR t.depth = (SELECT max(m.depth) FROM walk m)) t
 ORDER BY t.part, t.depth, t.scheduled_at, t.created_at, t.id
