-- counts (R161): rows of the group per (source, status). Parameters: $1 text consumer_group.
-- Returns (source text, status text, count int8).
SELECT source::text, status::text, count(*)::int8 FROM {table}
 WHERE consumer_group = $1::text
 GROUP BY source, status
