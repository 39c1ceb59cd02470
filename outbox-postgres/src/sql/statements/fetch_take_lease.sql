-- The end of fetch_take in lease delivery (R21, R76): stamp the lease with the database clock.
out AS (
    UPDATE {table} t
       SET locked_at = now(), locked_by = $1::text, updated_at = now()
      FROM final f
     WHERE t.id = f.id
    RETURNING {t_columns}, f.head_rank AS head_rank__, f.pos AS pos__
)
SELECT {columns} FROM out ORDER BY head_rank__, pos__
