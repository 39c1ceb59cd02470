-- requeue_failed (R64). Parameters: $1 uuid id. Affects 1 row when the row was 'failed', else 0.
UPDATE {table}
   SET status = 'pending', attempts_made = 0, last_error = NULL, scheduled_at = now(),
       completed_at = NULL, locked_at = NULL, locked_by = NULL, updated_at = now()
 WHERE id = $1::uuid AND status = 'failed'
