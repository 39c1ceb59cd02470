-- parked_stats (R193's gauges): the parked keys and the parked rows (pending with
-- attempts_made >= max_attempts), read from idx_<t>_parked. A key counts when any of its rows
-- is parked. No parameters. Returns two rows in the shape of `counts`, with its column names
-- (topic, status, count: the diesel driver decodes by name): ('keys', 'parked', n) and
-- ('rows', 'parked', n).
SELECT v.name AS topic, 'parked'::text AS status, v.n AS count
  FROM (SELECT count(DISTINCT (topic, partition_key))::int8 AS keys, count(*)::int8 AS rows
          FROM {table}
         WHERE status = 'pending' AND attempts_made >= max_attempts) p
 CROSS JOIN LATERAL (VALUES ('keys'::text, p.keys), ('rows'::text, p.rows)) AS v(name, n)
