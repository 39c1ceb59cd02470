-- in_line_rows (R149, R150, R161): the group's pending rows that stand in their key's line
-- (R27), optionally of some sources: the blocked keys' heads (the operator's view; the fetch
-- uses fetch_heads and fetch_walk). No LIMIT: the whole backlog.
-- Parameters: $1 text consumer_group, $2 text[] sources (NULL for all). Returns {columns}.
SELECT {t_columns}
  FROM {table} t
 WHERE t.consumer_group = $1::text AND ($2::text[] IS NULL OR t.source = ANY($2::text[]))
   AND {key_order:t} AND {in_line:t}
