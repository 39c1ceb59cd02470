-- fetch_take: lock the chosen heads, extend them into runs and hand the rows out (R19-R29,
-- R74, R81, R85). Second of the two fetch statements, in the transaction of fetch_heads.
--
-- Parameters:
--   $1 text    worker id (the lease holder; unused in transaction delivery)
--   $2 int8    batch size (>= 1)
--   $3 int8    lease TTL in microseconds
--   $4 int8    max_per_key (>= 1)
--   $5 text[]  topics, or NULL for any
--   $6 text[]  aggregate types, or NULL for any
--   $7 uuid[]  aggregate ids, or NULL for any
--   $8 uuid[]  the candidate heads from fetch_heads, in head order
--
-- Returns {columns} of the rows taken, in return order (R22): grouped by key, keys in head
-- order, each key's rows in write order. In lease delivery each row has locked_at =
-- updated_at = now() and locked_by = $1; in transaction delivery rows are returned as stored,
-- row-locked until the transaction ends.
--
-- Heads: the candidates are taken one after the other in head order, each row-locked with
-- SKIP LOCKED (fetchability checked again on the latest row version) and checked again for an
-- earlier in-line row of its key, until $2 are taken; nothing is locked past the $2-th head,
-- and a candidate that another relay holds is passed over, never waited for. Every lookup by
-- id here (the heads, the run locks, the lease stamp) goes through the primary key: its
-- predicates ({pending:...}, {due:...}) imply no partial index's predicate.
--
-- Runs: with H heads, each head is position 1 of its run; one read of the key's line after the
-- head (never-tried future rows passed over) of at most min($4 - 1, $2 - H) rows, cut at the
-- first row that is not fetchable or filtered out; the batch fills breadth-first (position,
-- then head rank); run rows are locked with SKIP LOCKED and each run is cut before its first
-- row that could not be locked, so no row goes out while an earlier row of its key is held
-- elsewhere (R28).
WITH
taken AS MATERIALIZED (
    SELECT h.id, h.topic, h.partition_key, h.created_at, c.ord
      FROM (SELECT u.id, u.ord FROM unnest($8::uuid[]) WITH ORDINALITY AS u(id, ord)
             ORDER BY u.ord) c
     CROSS JOIN LATERAL (
           SELECT hl.id, hl.topic, hl.partition_key, hl.created_at
             FROM {table} hl
            WHERE hl.id = c.id AND {pending:hl} AND {due:hl} AND {filters:hl}
              FOR UPDATE SKIP LOCKED
     ) h
      LEFT JOIN LATERAL ({earlier:h}) earlier ON true
     WHERE earlier.found IS NULL
     LIMIT $2::int8
),
ranked AS (
    SELECT t.*, row_number() OVER (ORDER BY t.ord) AS head_rank FROM taken t
),
runs AS (
    SELECT h.id, h.head_rank, 1::int8 AS pos, true AS prefix_ok
      FROM ranked h
    UNION ALL
    SELECT r.id, h.head_rank, r.pos,
           bool_and(r.ok) OVER (PARTITION BY h.head_rank ORDER BY r.pos) AS prefix_ok
      FROM ranked h
     CROSS JOIN LATERAL (
           SELECT q.id, 1 + row_number() OVER (ORDER BY q.created_at, q.id) AS pos, q.ok
             FROM (
                  SELECT l.id, l.created_at, ({due:l} AND {filters:l}) AS ok
                    FROM {table} l
                   WHERE {key_order:l} AND l.topic = h.topic
                     AND l.partition_key = h.partition_key
                     AND l.created_at >= h.created_at AND (l.created_at > h.created_at OR l.id > h.id)
                     AND {in_line:l}
                   ORDER BY l.created_at, l.id
                   LIMIT LEAST($4::int8 - 1, $2::int8 - (SELECT count(*) FROM ranked))
             ) q
     ) r
),
picked AS (
    SELECT id, head_rank, pos FROM runs
     WHERE prefix_ok
     ORDER BY pos, head_rank
     LIMIT $2::int8
),
locked AS (
    SELECT lk.id FROM {table} lk
     WHERE lk.id = ANY(ARRAY(SELECT id FROM picked WHERE pos > 1)) AND {pending:lk} AND {due:lk}
       FOR UPDATE SKIP LOCKED
),
final AS (
    SELECT z.id, z.head_rank, z.pos FROM (
        SELECT p.id, p.head_rank, p.pos,
               bool_and(p.pos = 1 OR lk.id IS NOT NULL)
                   OVER (PARTITION BY p.head_rank ORDER BY p.pos) AS still_ok
          FROM picked p LEFT JOIN locked lk ON lk.id = p.id
    ) z
     WHERE z.still_ok
),
{finish}
