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
-- Written like the `earlier` probe (see it): `same_key`, and the order (`key_first`,
-- created_at, id) that only that index yields (but for id), so that no other index can serve
-- the read whatever the planner's statistics.
SELECT {t_columns}
  FROM (SELECT $1::text AS consumer_group, u.*
          FROM unnest($2::text[], $3::text[], $4::timestamptz[], $5::uuid[])
                   AS u(source, partition_key, created_at, id)) h
 CROSS JOIN LATERAL (
       SELECT e.*
         FROM {table} e
        WHERE {key_order:e} AND {same_key:h}
          AND e.created_at >= h.created_at AND (e.created_at > h.created_at OR e.id > h.id)
          AND {in_line:e}
        ORDER BY {key_first:e}, e.created_at, e.id
        LIMIT $6::int8
 ) t
