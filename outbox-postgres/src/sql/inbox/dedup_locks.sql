-- dedup_locks (R185 step 2, partitioned table): the dedup advisory locks of dedup_lock.sql for
-- the dedup keys of a batch that no stored row has yet, in ascending order of
-- (hashtext(message_id), hashtext(consumer_group)), before the batch's landing, so that a
-- runner's batch and a processor's T_b (R189) take them in one order. A key already stored
-- needs no insert and so no lock (land_event, G-05).
-- Parameters: $1 text[] message_id, $2 text[] consumer_group. Returns one row, one column
-- `n int8`: the locks taken.
SELECT count(pg_advisory_xact_lock(a, b))::int8 AS n
  FROM (SELECT DISTINCT hashtext(k.m) AS a, hashtext(k.g) AS b
          FROM unnest($1::text[], $2::text[]) AS k(m, g)
         WHERE NOT EXISTS (SELECT 1 FROM {table} t
                            WHERE t.message_id = k.m AND t.consumer_group = k.g)
         ORDER BY a, b) locks
