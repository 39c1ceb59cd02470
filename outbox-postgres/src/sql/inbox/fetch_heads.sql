-- fetch_heads (R149, R150, R20, R27-R29, R85): the heads a fetch may take, read from a window
-- of the group's oldest fetchable rows, whatever the backlog. First statement of the fetch,
-- in its transaction; fetch_runs extends the heads, the store chooses and stamps the batch.
--
-- Parameters:
--   $1 text    consumer_group
--   $2 text[]  sources, or NULL for all
--   $3 int8    lease TTL in microseconds (a lease older than that has expired)
--   $4 int4    key_order (1 on, 0 off: every row a key of its own, R147)
--   $5 int8    batch size (>= 1): at most this many heads
--   $6 int8    window: how many of the oldest fetchable rows are read
--
-- Returns {columns} of the heads in head order (scheduled_at, created_at, id).
--
-- The window: the $6 oldest fetchable rows of the group, row-locked with SKIP LOCKED as they
-- are read, so concurrent fetches read disjoint windows: the unlocked ones (`window_unlocked`)
-- in (scheduled_at, created_at, id) order from idx_<p>_pending_window, the only index their
-- predicate implies, and those under an expired lease (`window_expired`, rare) from
-- idx_<p>_locked_at; each range stops at $6 rows, whatever the planner's statistics say. Only
-- the earliest window row of each inbox key can be its head; it is one when no earlier in-line
-- row of its key exists (one LIMIT 1 probe of idx_<p>_pending_key_order, the outbox's
-- `earlier` with the inbox key), which also catches an earlier row that another transaction
-- holds (skipped by the window, still in line). A row without partition_key, and every row
-- with key order off, is a key of its own and a head whenever it is fetchable (R150). Keys are
-- probed in head order and the probes stop at $5 heads. A head outside the window (a window
-- full of rows queued behind blocked heads) is found by fetch_walk, the bounded key walk the
-- store runs when this returns fewer than $5 heads and window_overflow says the group has more
-- fetchable rows than the window (PgInbox).
--
-- The window's rows are read whole, once (the index read fetches each row for its lock
-- anyway), and the heads are returned from them: no lookup by id follows. The sorts carry only
-- the window's key columns, never the payloads.
WITH
win_u AS MATERIALIZED (
    SELECT {t_columns}
      FROM {table} t
     WHERE {window_unlocked:t}
     ORDER BY t.scheduled_at, t.created_at, t.id
     LIMIT $6::int8
       FOR UPDATE SKIP LOCKED
),
win_x AS MATERIALIZED (
    SELECT {t_columns}
      FROM {table} t
     WHERE {window_expired:t}
     ORDER BY t.scheduled_at, t.created_at, t.id
     LIMIT $6::int8
       FOR UPDATE SKIP LOCKED
),
win AS (
    SELECT w.id, w.consumer_group, w.source, w.partition_key, w.scheduled_at, w.created_at,
           CASE WHEN $4::int4 = 1 THEN w.partition_key END AS line_key,
           CASE WHEN $4::int4 = 1 AND w.partition_key IS NOT NULL THEN NULL ELSE w.id END
               AS own_key
      FROM (SELECT r.id, r.consumer_group, r.source, r.partition_key, r.scheduled_at,
                   r.created_at
              FROM win_u r
            UNION ALL
            SELECT r.id, r.consumer_group, r.source, r.partition_key, r.scheduled_at,
                   r.created_at
              FROM win_x r) w
     ORDER BY w.scheduled_at, w.created_at, w.id
     LIMIT $6::int8
),
heads AS MATERIALIZED (
    SELECT c.id
      FROM (SELECT k.* FROM (SELECT DISTINCT ON (d.source, d.line_key, d.own_key) d.*
                               FROM win d
                              ORDER BY d.source, d.line_key, d.own_key, d.created_at, d.id) k
             ORDER BY k.scheduled_at, k.created_at, k.id) c
      LEFT JOIN LATERAL ({earlier:c}) earlier ON c.own_key IS NULL
     WHERE earlier.found IS NULL
     LIMIT $5::int8
)
SELECT t.*
  FROM (SELECT * FROM win_u UNION ALL SELECT * FROM win_x) t
 WHERE t.id = ANY(ARRAY(SELECT h.id FROM heads h))
 ORDER BY t.scheduled_at, t.created_at, t.id
