-- The end of fetch_take in transaction delivery (R84): no write; the rows stay row-locked until
-- the cycle's transaction commits its outcomes or rolls back. $1 is not used.
--
-- $9 text: the server's bound on the delivery transaction, in milliseconds (e.g. '5000'): the
-- server ends this transaction (and its session) when it stays idle longer than that, so a
-- relay that goes silent never pins its rows. SET LOCAL semantics (set_config(..., true)), so
-- it ends with the transaction and is safe behind a transaction-pooling proxy. Set here, in
-- the statement that takes the rows, rather than in a statement of its own: the transaction
-- holds nothing before it (the heads statement ran in its own transaction), and the setting is
-- in place before the first idle moment after it.
out AS (
    SELECT {t_columns}, f.head_rank AS head_rank__, f.pos AS pos__, $1::text AS worker__
      FROM {table} t JOIN final f ON t.id = f.id
)
SELECT {columns} FROM out
 WHERE (SELECT set_config('idle_in_transaction_session_timeout', $9::text, true)) IS NOT NULL
 ORDER BY head_rank__, pos__
