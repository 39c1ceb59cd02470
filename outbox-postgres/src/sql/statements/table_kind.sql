-- table_kind (schema checks of the relay binary, before it runs or migrates): what stands under
-- the table's name in pg_class, as its relkind: 'r' an ordinary table, 'p' a partitioned one,
-- another letter something else (a view, say); no row when nothing has that name.
--
-- $1 text: the table's dotted name, as `TableName::dotted` spells it (bound, never spliced).
-- Returns at most one row, one column relkind text.
SELECT c.relkind::text AS relkind FROM pg_class c WHERE c.oid = to_regclass($1)
