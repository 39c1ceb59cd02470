-- write (R126, R128, R154, R56): one outcome write to a row the transaction holds the lock of.
-- Every write sets updated_at = now() and releases the lease. Two forms as lock_row's:
-- `write_at` finds the row by the primary key of both layouts (`{at}` is
-- `AND t.created_at = $7::timestamptz`), `write` by id alone (`{at}` empty: a row read
-- undecoded, R106).
-- Parameters: $1 uuid id, $2 text kind: 'complete' (completed, completed_at = now(); attempts
-- and last_error kept), 'counted' (attempts_made + 1, 'failed' when it reaches max_attempts),
-- 'not_counted' (no attempt spent), 'terminal' ('failed', attempts_made = max_attempts),
-- 'counted_park' and 'terminal_park' (as 'counted' and 'terminal' but the status stays
-- 'pending': the row is parked when its attempts are spent, R191) or 'clear_lease' (only the
-- release); $3 text[] last_error (already normalized, R9; for counted,
-- not_counted and terminal); $4 int8[] retry after this many microseconds from now() and $5
-- timestamptz[] explicit retry time (wins over $4); both NULL keep scheduled_at (counted and
-- not_counted only); $6 text[] a statement_timeout to put back (R181 step 4) for the statements
-- after this one (the commit), NULL to leave it. $3 to $6 are one-element arrays, nullable
-- scalars (see driver::inbox); ($7 timestamptz created_at).
-- Returns {columns} of the row as written, then `timeout_restored text` (NULL when $6 is).
UPDATE {table} t
   SET status = CASE
           WHEN $2::text = 'complete' THEN 'completed'
           WHEN $2::text IN ('counted_park', 'terminal_park') THEN t.status
           WHEN $2::text = 'terminal' THEN 'failed'
           WHEN $2::text = 'counted' AND t.attempts_made + 1 >= t.max_attempts THEN 'failed'
           ELSE t.status END,
       completed_at = CASE WHEN $2::text = 'complete' THEN now() ELSE t.completed_at END,
       attempts_made = CASE
           WHEN $2::text IN ('counted', 'counted_park') THEN t.attempts_made + 1
           WHEN $2::text IN ('terminal', 'terminal_park') THEN t.max_attempts
           ELSE t.attempts_made END,
       last_error = CASE
           WHEN $2::text IN ('counted', 'counted_park', 'not_counted', 'terminal', 'terminal_park')
               THEN ($3::text[])[1]
           ELSE t.last_error END,
       scheduled_at = CASE
           WHEN $2::text IN ('counted', 'counted_park', 'not_counted')
               THEN COALESCE(($5::timestamptz[])[1], now() + ($4::int8[])[1] * INTERVAL '1 microsecond',
                             t.scheduled_at)
           ELSE t.scheduled_at END,
       locked_at = NULL, locked_by = NULL, updated_at = now()
 WHERE t.id = $1::uuid {at}
RETURNING {t_columns},
          CASE WHEN ($6::text[])[1] IS NOT NULL
               THEN set_config('statement_timeout', ($6::text[])[1], true) END AS timeout_restored
