-- lock_row_run (R152, R181): lock_row.sql for the processor's guard on the plain table, which
-- also sets the handler timeout for the rest of T_row in the same round trip (R181 step 1,
-- R165): `set_config('statement_timeout', …, true)` (SET LOCAL) on the row it returns, in force
-- from the next statement on, the setting before returned as `timeout_before` for the restore
-- (R181 step 4: a rollback to the savepoint keeps a setting made before it; the store restores
-- it with the outcome write, write.sql's $6). On the plain table nothing between the guard and
-- the savepoint waits (no sibling check, R164), so the timeout bounds no wait of the store's.
-- The row is found by the primary key of both layouts (created_at, id) (see lock_row).
-- Parameters: $1 uuid id, $2 text the handler timeout in whole milliseconds, $3 timestamptz
-- created_at.
-- Returns {columns}, `timeout_before text`, `timeout_set text` of the row when this
-- transaction locked it; no row when another transaction holds its lock or it does not exist.
SELECT {t_columns}, b.before AS timeout_before,
       set_config('statement_timeout', $2::text, true) AS timeout_set
  FROM {table} t
 CROSS JOIN LATERAL (SELECT current_setting('statement_timeout') AS before) b
 WHERE t.id = $1::uuid AND t.created_at = $3::timestamptz
   FOR UPDATE OF t SKIP LOCKED
