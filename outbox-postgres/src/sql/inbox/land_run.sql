-- land_run (R107, R109, R110, R116, R181): the runner's landing in T, after the key lock: the
-- insert of land.sql and, for the row it inserts, in the same round trip, what T asks next.
-- * `earlier` (R116, R145): the `earlier` probe of earlier.sql on the inserted row. This
--   statement's snapshot is taken after the key lock's statement returned, so the probe sees
--   every row that an earlier holder of the key lock committed (the probe never reads the row
--   inserted here, which is not before itself).
-- * the handler timeout (R181 step 1, R165) when $14 is given and no earlier row is in line
--   (so the row will run): `set_config('statement_timeout', …, true)` (SET LOCAL), in force
--   from the next statement on, with the setting before it returned as `timeout_before` for
--   the restore (R181 step 4). Set here, before the savepoint, a rollback to the savepoint
--   keeps it; the store restores it with the outcome write (write.sql's $6).
-- No row lock is taken: the inserting transaction holds the new row, which no other
-- transaction sees before T commits (R116 step 3). Nothing inserted (a duplicate): no row;
-- the caller reads the stored one with by_message_id and lock_row, in statements of their own.
-- The CTE i is land.sql itself, put in at render time (the insert is written once).
-- Parameters: $1 to $13 as land.sql; $14 text[] the handler timeout in whole milliseconds, a
-- one-element array, NULL for none (a nullable scalar, see driver::inbox).
-- Returns {columns} of the row inserted, then `earlier bool`, `timeout_before text` (NULL when
-- the timeout was not set), `timeout_set text`; or no row.
WITH i AS (
{land}
)
SELECT i.*, p.earlier,
       CASE WHEN p.run THEN b.before END AS timeout_before,
       CASE WHEN p.run THEN set_config('statement_timeout', ($14::text[])[1], true) END
           AS timeout_set
  FROM i
 CROSS JOIN LATERAL (SELECT e.earlier, ($14::text[])[1] IS NOT NULL AND NOT e.earlier AS run
                       FROM (SELECT EXISTS ({earlier:i}) AS earlier) e) p
 CROSS JOIN LATERAL (SELECT current_setting('statement_timeout') AS before) b
