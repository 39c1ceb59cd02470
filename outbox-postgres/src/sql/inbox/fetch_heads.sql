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
-- The window: the $6 oldest fetchable rows of the group ({due:u}, which implies no predicate
-- but idx_<p>_pending_group's, read in that index's order), row-locked with SKIP LOCKED as they
-- are read, so concurrent fetches read disjoint windows. Only the earliest window row of each
-- inbox key can be its head; it is one when no earlier in-line row of its key exists (one
-- LIMIT 1 probe of idx_<p>_pending_key_order, the outbox's `earlier` with the inbox key),
-- which also catches an earlier row that another transaction holds (skipped by the window,
-- still in line). A row without partition_key, and every row with key order off, is a key of
-- its own and a head whenever it is fetchable (R150). Keys are probed in head order and the
-- probes stop at $5 heads. A head outside the window (a window full of rows queued behind
-- blocked heads) is the store's business: it reads the whole line then (PgInbox).
WITH
win AS MATERIALIZED (
    SELECT u.id, u.consumer_group, u.source, u.partition_key, u.scheduled_at, u.created_at,
           CASE WHEN $4::int4 = 1 THEN u.partition_key END AS line_key,
           CASE WHEN $4::int4 = 1 AND u.partition_key IS NOT NULL THEN NULL ELSE u.id END
               AS own_key
      FROM {table} u
     WHERE u.consumer_group = $1::text AND {key_order:u} AND {due:u}
       AND ($2::text[] IS NULL OR u.source = ANY($2::text[]))
     ORDER BY u.scheduled_at, u.created_at, u.id
     LIMIT $6::int8
       FOR UPDATE SKIP LOCKED
),
heads AS MATERIALIZED (
    SELECT c.id, c.scheduled_at, c.created_at
      FROM (SELECT k.* FROM (SELECT DISTINCT ON (d.source, d.line_key, d.own_key) d.*
                               FROM win d
                              ORDER BY d.source, d.line_key, d.own_key, d.created_at, d.id) k
             ORDER BY k.scheduled_at, k.created_at, k.id) c
      LEFT JOIN LATERAL ({earlier:c}) earlier ON c.own_key IS NULL
     WHERE earlier.found IS NULL
     LIMIT $5::int8
)
SELECT {t_columns}
  FROM heads h JOIN {table} t ON t.id = h.id AND t.created_at = h.created_at
 ORDER BY h.scheduled_at, h.created_at, h.id
