-- equivalent_index (R173): whether the table already has an index with the same columns,
-- uniqueness and predicate as the probe index (built on a LIKE copy of the table), under any
-- name: the ancestor named the indexes of any table with the fixed prefixes.
-- Parameters: $1 text the table (schema.table), $2 text the probe index (pg_temp.name).
-- Returns one row, one column `n int8` (1 or 0).
SELECT count(*)::int8 AS n FROM (
    SELECT 1
      FROM pg_index x, pg_index p
     WHERE x.indrelid = $1::text::regclass AND p.indexrelid = $2::text::regclass
       AND x.indisunique = p.indisunique
       AND regexp_replace(pg_get_indexdef(x.indexrelid),
                          '^CREATE (UNIQUE )?INDEX \S+ ON (ONLY )?\S+ (USING btree )?', '')
         = regexp_replace(pg_get_indexdef(p.indexrelid),
                          '^CREATE (UNIQUE )?INDEX \S+ ON (ONLY )?\S+ (USING btree )?', '')
     LIMIT 1
) e
