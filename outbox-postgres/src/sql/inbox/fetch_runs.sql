-- fetch_runs (R150, R74, R85): the in-line rows after each keyed head, in write order, for the
-- runs of max_per_key. Second statement of the fetch; nothing is locked here (the store locks
-- the run rows it chooses with try_lock and cuts a run before a row it could not lock, R28).
--
-- Parameters:
--   $1 text        consumer_group
--   $2 text[]      the heads' sources
--   $3 text[]      the heads' partition keys
--   $4 timestamptz[] the heads' created_at
--   $5 uuid[]      the heads' ids
--   $6 int8        at most this many rows per head: min(max_per_key - 1, batch - heads)
--
-- Returns {columns} of the rows, per head one read of its key's line after it (never-tried
-- future rows passed over, R29): one descent of idx_<p>_pending_key_order each, bounded by $6.
SELECT {t_columns}
  FROM unnest($2::text[], $3::text[], $4::timestamptz[], $5::uuid[])
           AS h(source, partition_key, created_at, id)
 CROSS JOIN LATERAL (
       SELECT l.*
         FROM {table} l
        WHERE {key_order:l} AND l.consumer_group = $1::text AND l.source = h.source
          AND l.partition_key = h.partition_key
          AND l.created_at >= h.created_at AND (l.created_at > h.created_at OR l.id > h.id)
          AND {in_line:l}
        ORDER BY l.created_at, l.id
        LIMIT $6::int8
 ) t
