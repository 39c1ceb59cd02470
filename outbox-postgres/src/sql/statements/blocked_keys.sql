-- blocked_keys (R80, R85, R193): keys whose head waits for a retry, is held under a live lease
-- or is parked (pending with attempts_made >= max_attempts, R191).
--
-- Parameters:
--   $1 int8  lease TTL in microseconds (a lock younger than that is a live lease)
--   $2 int8  limit: at most this many keys
--   $3 int8  candidate bound: how many rows each of the two sources below reads at most
--   $4 int8  waiting cap: the count of rows behind a head stops here
--
-- Returns rows of (topic text, partition_key text, head_id uuid, attempts_made int4,
-- max_attempts int4, last_error text NULL, next_try timestamptz, locked_by text NULL,
-- locked_at timestamptz NULL, waiting int8, parked_at timestamptz NULL: the head's updated_at
-- when it is parked), oldest head first (write order).
--
-- Bounded by its arguments, never by the backlog: candidates are the $3 rows with the
-- earliest next try among rows waiting for a retry (idx_<t>_pending_window, scheduled_at
-- after now, last_error set), the $3 oldest live leases (idx_<t>_locked_at) and the $3 oldest
-- parked rows (idx_<t>_parked, in its order and predicate); each is
-- checked for an earlier in-line row of its key (one probe), and waiting counts at most $4
-- rows behind the head.
WITH
retry AS (
    SELECT r.id FROM (
        SELECT u.id, u.last_error
          FROM {table} u
         WHERE {window:u} AND u.scheduled_at > now()
         ORDER BY u.scheduled_at
         LIMIT $3::int8
    ) r
     WHERE r.last_error IS NOT NULL
),
held AS (
    SELECT l.id
      FROM {table} l
     WHERE l.locked_at >= now() - $1::int8 * INTERVAL '1 microsecond' AND {pending:l}
     ORDER BY l.locked_at
     LIMIT $3::int8
),
parked AS (
    SELECT p.id
      FROM {table} p
     WHERE p.status = 'pending' AND p.attempts_made >= p.max_attempts
     ORDER BY p.created_at, p.id
     LIMIT $3::int8
),
heads AS (
    SELECT h.id, h.topic, h.partition_key, h.attempts_made, h.max_attempts, h.last_error,
           h.scheduled_at, h.locked_by, h.locked_at, h.created_at, h.updated_at
      FROM (SELECT id FROM retry UNION SELECT id FROM held UNION SELECT id FROM parked) c
      JOIN {table} h ON h.id = c.id
      LEFT JOIN LATERAL ({earlier:h}) earlier ON true
     WHERE earlier.found IS NULL
     ORDER BY h.created_at, h.id
     LIMIT $2::int8
)
SELECT h.topic::text, h.partition_key::text, h.id AS head_id, h.attempts_made, h.max_attempts,
       h.last_error::text, h.scheduled_at AS next_try, h.locked_by::text, h.locked_at,
       (SELECT count(*) FROM (
            SELECT 1 FROM {table} w
             WHERE {key_order:w} AND w.topic = h.topic AND w.partition_key = h.partition_key
               AND w.created_at >= h.created_at AND (w.created_at > h.created_at OR w.id > h.id)
             LIMIT $4::int8) n)::int8 AS waiting,
       CASE WHEN h.attempts_made >= h.max_attempts THEN h.updated_at END AS parked_at
  FROM heads h
 ORDER BY h.created_at, h.id
