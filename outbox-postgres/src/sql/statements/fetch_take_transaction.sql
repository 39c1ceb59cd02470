-- The end of fetch_take in transaction delivery (R84): no write; the rows stay row-locked until
-- the cycle's transaction commits its outcomes or rolls back. $1 is not used.
out AS (
    SELECT {t_columns}, f.head_rank AS head_rank__, f.pos AS pos__, $1::text AS worker__
      FROM {table} t JOIN final f ON t.id = f.id
)
SELECT {columns} FROM out ORDER BY head_rank__, pos__
