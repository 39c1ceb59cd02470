-- counts (R80): no parameters. Returns (topic text, status text, count int8), sorted by topic
-- then status. Reads the whole table: an operator query, not one for every cycle.
SELECT topic::text, status::text, count(*)::int8 FROM {table}
 GROUP BY topic, status ORDER BY topic, status
