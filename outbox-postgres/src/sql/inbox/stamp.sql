-- stamp (R21, R149): the lease on rows this fetch row-locked.
-- Parameters: $1 uuid[] ids, $2 text worker. Returns {columns} of the rows stamped.
UPDATE {table} t SET locked_at = now(), locked_by = $2::text, updated_at = now()
 WHERE t.id = ANY($1::uuid[]) AND {pending:t}
RETURNING {t_columns}
