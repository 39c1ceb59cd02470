-- key_locks (R185 step 1): a batch's key locks, the advisory locks of key_lock.sql, every
-- distinct key once, taken in ascending order of the 64-bit hash that names each lock, so that
-- two batches that share keys wait in one order and cannot deadlock (BT-07).
-- Parameters: $1 text[] consumer_group, $2 text[] source, $3 text[] partition_key (one element
-- per key). Returns one row, one column `n int8`: the locks taken.
SELECT count(pg_advisory_xact_lock(h))::int8 AS n
  FROM (SELECT DISTINCT hashtextextended(json_build_array(g, s, p)::text, 0) AS h
          FROM unnest($1::text[], $2::text[], $3::text[]) AS k(g, s, p)
         ORDER BY h) locks
