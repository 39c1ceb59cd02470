-- fail: counted (R38), transient (R43, R44) and deferred (R47) failures of many rows in one
-- statement, guarded by the lease holder (R54).
-- Parameters, arrays of equal length: $1 uuid[] ids, $2 bool[] counted (attempts_made + 1,
-- 'failed' at max_attempts), $3 text[] last_error (already normalized, R9), $4 int8[] retry
-- after this many microseconds from now() (NULL elements), $5 timestamptz[] explicit retry
-- time (NULL elements; wins over $4); then $6 text worker; $7 bool[] park (R191: a counted
-- failure that spends the last attempt keeps the row 'pending', parked). Both NULL keep
-- scheduled_at (backoff base 0, deferral).
-- {holder}: lease delivery guards each row by its holder (t.locked_by = $6); delivery in one
-- transaction (R84) by the row lock it already holds ($6 unused but typed).
-- Returns (id uuid, status text, attempts_made int4, scheduled_at timestamptz) of the rows
-- written; ids not returned lost their lease (R55).
UPDATE {table} t
   SET attempts_made = t.attempts_made + CASE WHEN o.counted THEN 1 ELSE 0 END,
       status = CASE WHEN o.counted AND NOT o.park AND t.attempts_made + 1 >= t.max_attempts
                     THEN 'failed' ELSE t.status END,
       last_error = o.error,
       scheduled_at = CASE WHEN o.retry_at IS NOT NULL THEN o.retry_at
                           WHEN o.after_us IS NOT NULL
                           THEN now() + o.after_us * INTERVAL '1 microsecond'
                           ELSE t.scheduled_at END,
       locked_at = NULL, locked_by = NULL, updated_at = now()
  FROM unnest($1::uuid[], $2::bool[], $3::text[], $4::int8[], $5::timestamptz[], $7::bool[])
       AS o(id, counted, error, after_us, retry_at, park)
 WHERE t.id = o.id AND {pending:t} AND {holder}
RETURNING t.id, t.status::text, t.attempts_made, t.scheduled_at
