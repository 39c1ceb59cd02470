-- fetch_heads: choose the heads a fetch may take (R20, R27-R29, R85). First of the two fetch
-- statements; run it in the fetch transaction, then fetch_take with the ids it returns.
--
-- Parameters:
--   $1 int8    batch size (>= 1)
--   $2 int8    lease TTL in microseconds (a lease older than that has expired)
--   $3 text[]  topics, or NULL for any
--   $4 text[]  aggregate types, or NULL for any
--   $5 uuid[]  aggregate ids, or NULL for any
--   $6 int8    window: how many of the oldest fetchable rows path A reads
--   $7 int8    walk limit: how many keys path B visits at most
--   $8 text    walk cursor, topic: path B starts at the first key >= ($8, $9)
--   $9 text    walk cursor, partition key ('' and '' start at the first key)
--
-- Returns rows of (head_id uuid, topic text, partition_key text): the candidate heads in head
-- order (scheduled_at, created_at, id), then, when path B walked, one last row with head_id NULL
-- naming the last key it visited (the caller's next cursor).
--
-- Path A, the window: the $6 oldest fetchable rows, unlocked ones read in order from
-- idx_<t>_pending_window (the only index their predicate, {window:u}, implies), so the read
-- stops at the LIMIT whatever the statistics. Unlocked rows are row-locked with SKIP
-- LOCKED as they are read, so concurrent fetches read disjoint windows instead of colliding on
-- the same one; rows under an expired lease (rare) are read without a lock, so a table full of
-- them does not make the fetch lock twice the window, and fetch_take locks the ones it takes.
-- Only the earliest window row of each key can be its head; it is one when no earlier in-line
-- row of its key exists (one LIMIT 1 probe of idx_<t>_pending_key_order per key, filters
-- ignored, R29). Keys are probed in head order and the probes stop at $1 heads: a fetch takes
-- at most $1, so probing the window's other keys (about 85 of 185 in a 200-row window) was
-- server time spent on candidates fetch_take never reached.
--
-- Path B, the walk, runs only when path A found fewer than $1 heads (the window is full of rows
-- queued behind blocked heads, or of one hot key). It visits keys in (topic, partition_key)
-- order from the cursor, wrapping around once, reading each key's first in-line row in one
-- descent of idx_<t>_pending_key_order, and stops after $1 fetchable heads or $7 keys: its cost
-- is bounded by the batch, never by the number of keys (R85), and the cursor makes every key's
-- turn come within a bounded number of fetches (R20). Walk heads are not locked here.
--
-- Nothing here takes an advisory lock, and the only row locks are at most $6 window rows.
--
-- Planning: the statement is prepared once per connection and must run on PostgreSQL's
-- generic plan, or every fetch plans it again (about as long as it runs, measured in
-- examples/BENCHMARKS.md). PostgreSQL keeps a generic plan only when its estimated cost is
-- below the custom plans' average; in the generic plan the lease TTL $2 is unknown, so a
-- lone `x.locked_at < now() - $2 ...` is estimated at a third of the table (a bitmap read of
-- the whole table, ten times the custom plan's cost) and the generic plan was never chosen.
-- Written as a range, `x.locked_at >= '-infinity' AND x.locked_at < ...` (the same rows:
-- locked_at is not null), it is estimated as a narrow range, as it is in fact.
--
-- Two renderings ({own_commit}): `fetch_heads`, run inside the lease fetch's transaction
-- before the take, where the window's row locks last until that transaction commits; and
-- `fetch_heads_autocommit`, which transaction delivery runs in autocommit before it begins the
-- delivery transaction, so the window's row locks end with the statement's own transaction
-- (the delivery then holds only the rows it takes; the take checks every head again). Row
-- locks are all that transaction writes, so its commit need not wait for the WAL flush: that
-- rendering sets synchronous_commit off for its own transaction (set_config(..., true),
-- transaction-local; a lost commit record of row locks loses nothing). Run it in autocommit
-- only: inside a transaction the setting would apply to that transaction's commit.
WITH RECURSIVE
win_u AS MATERIALIZED (
    SELECT u.id, u.topic, u.partition_key, u.scheduled_at, u.created_at
      FROM {table} u
     WHERE {window:u} AND u.scheduled_at <= now() AND {filters:u}
     ORDER BY u.scheduled_at, u.created_at, u.id
     LIMIT $6::int8
       FOR UPDATE SKIP LOCKED
),
win_x AS MATERIALIZED (
    SELECT x.id, x.topic, x.partition_key, x.scheduled_at, x.created_at
      FROM {table} x
     WHERE x.locked_at >= '-infinity'::timestamptz
       AND x.locked_at < now() - $2::int8 * INTERVAL '1 microsecond'
       AND {pending:x} AND x.attempts_made < x.max_attempts AND x.scheduled_at <= now()
       AND {filters:x}
     ORDER BY x.scheduled_at, x.created_at, x.id
     LIMIT $6::int8
),
win AS (
    SELECT w.* FROM (SELECT * FROM win_u UNION ALL SELECT * FROM win_x) w
     ORDER BY w.scheduled_at, w.created_at, w.id
     LIMIT $6::int8
),
heads_a AS MATERIALIZED (
    SELECT c.id, c.topic, c.partition_key, c.scheduled_at, c.created_at
      FROM (SELECT k.* FROM (SELECT DISTINCT ON (d.topic, d.partition_key) d.*
                               FROM win d
                              ORDER BY d.topic, d.partition_key, d.created_at, d.id) k
             ORDER BY k.scheduled_at, k.created_at, k.id) c
      LEFT JOIN LATERAL ({earlier:c}) earlier ON true
     WHERE earlier.found IS NULL
     LIMIT $1::int8
),
walk AS (
    SELECT 1 AS depth, f.*, o.ok, o.ok::int AS found
      FROM (
           (SELECT s.*, false AS wrapped FROM (
                SELECT k.id, k.topic, k.partition_key, k.scheduled_at, k.created_at, k.status,
                       k.attempts_made, k.max_attempts, k.locked_at, k.aggregate_type,
                       k.aggregate_id
                  FROM {table} k
                 WHERE {key_order:k}
                   AND (k.topic, k.partition_key) >= ($8::text, $9::text)
                   AND {in_line:k}
                 ORDER BY k.topic, k.partition_key, k.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           UNION ALL
           (SELECT s.*, true AS wrapped FROM (
                SELECT k.id, k.topic, k.partition_key, k.scheduled_at, k.created_at, k.status,
                       k.attempts_made, k.max_attempts, k.locked_at, k.aggregate_type,
                       k.aggregate_id
                  FROM {table} k
                 WHERE {key_order:k}
                   AND {in_line:k}
                 ORDER BY k.topic, k.partition_key, k.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           LIMIT 1
      ) f
     CROSS JOIN LATERAL (SELECT {due:f} AND {filters:f} AS ok) o
     WHERE (SELECT count(*) FROM heads_a) < $1::int8
    UNION ALL
    SELECT p.depth + 1, n.*, o.ok, p.found + o.ok::int
      FROM walk p
     CROSS JOIN LATERAL (
           (SELECT s.*, p.wrapped AS wrapped FROM (
                SELECT k.id, k.topic, k.partition_key, k.scheduled_at, k.created_at, k.status,
                       k.attempts_made, k.max_attempts, k.locked_at, k.aggregate_type,
                       k.aggregate_id
                  FROM {table} k
                 WHERE {key_order:k}
                   AND (k.topic, k.partition_key) > (p.topic, p.partition_key)
                   AND {in_line:k}
                 ORDER BY k.topic, k.partition_key, k.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           UNION ALL
           (SELECT s.*, true AS wrapped FROM (
                SELECT k.id, k.topic, k.partition_key, k.scheduled_at, k.created_at, k.status,
                       k.attempts_made, k.max_attempts, k.locked_at, k.aggregate_type,
                       k.aggregate_id
                  FROM {table} k
                 WHERE {key_order:k} AND NOT p.wrapped
                   AND {in_line:k}
                 ORDER BY k.topic, k.partition_key, k.created_at
                 FETCH FIRST 1 ROWS WITH TIES) s
            ORDER BY s.id LIMIT 1)
           LIMIT 1
     ) n
     CROSS JOIN LATERAL (SELECT {due:n} AND {filters:n} AS ok) o
     WHERE p.depth < $7::int8 AND p.found < $1::int8
       AND NOT (n.wrapped AND (n.topic, n.partition_key) >= ($8::text, $9::text))
),
heads AS (
    SELECT id, topic, partition_key, scheduled_at, created_at FROM heads_a
    UNION
    SELECT w.id, w.topic, w.partition_key, w.scheduled_at, w.created_at FROM walk w
     WHERE w.ok
)
SELECT r.head_id, r.topic::text, r.partition_key::text FROM (
    SELECT h.id AS head_id, h.topic, h.partition_key, 0 AS part, h.scheduled_at, h.created_at
      FROM heads h
    UNION ALL
    (SELECT NULL::uuid, w.topic, w.partition_key, 1, NULL::timestamptz, NULL::timestamptz
       FROM walk w ORDER BY w.depth DESC LIMIT 1)
) r
{own_commit}
ORDER BY r.part, r.scheduled_at, r.created_at, r.head_id
