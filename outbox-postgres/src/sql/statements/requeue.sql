-- requeue_failed (R64, R162, R192): a 'failed' or parked row (pending with attempts_made >=
-- max_attempts) back to pending with no attempts, no error, due now, released.
-- Parameters: $1 uuid id. Affects 1 row when the row was failed or parked, else 0.
UPDATE {table}
   SET status = 'pending', attempts_made = 0, last_error = NULL, scheduled_at = now(),
       completed_at = NULL, locked_at = NULL, locked_by = NULL, updated_at = now()
 WHERE id = $1::uuid
   AND (status = 'failed' OR (status = 'pending' AND attempts_made >= max_attempts))
