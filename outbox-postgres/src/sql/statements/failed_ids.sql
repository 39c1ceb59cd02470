-- failed_ids (the relay binary's requeue of a topic or key): the ids of the failed rows of a
-- topic and/or key, oldest first.
--
-- $1 text topic, or NULL for any; $2 text partition_key, or NULL for any. Returns id uuid per
-- failed row, in write order (created_at, then id).
SELECT id
  FROM {table}
 WHERE status = 'failed' AND ($1::text IS NULL OR topic = $1)
   AND ($2::text IS NULL OR partition_key = $2)
 ORDER BY created_at, id
