-- complete_rows (R154, R189): write.sql's 'complete' of several rows the transaction holds the
-- locks of, in one statement (a processor transaction's completions, before its commit): status
-- completed, completed_at = now(), attempts_made and last_error kept, the lease released,
-- updated_at = now(). Each row found by the primary key of both layouts (created_at, id), as
-- lock_rows.sql does.
-- Parameters: $1 uuid[] ids, $2 timestamptz[] created_at, pairwise. Returns the rows written
-- (the count).
UPDATE {table} t
   SET status = 'completed', completed_at = now(), locked_at = NULL, locked_by = NULL,
       updated_at = now()
 WHERE t.id = ANY($1::uuid[]) AND t.created_at = ANY($2::timestamptz[])
