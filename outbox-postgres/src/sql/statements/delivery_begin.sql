-- delivery_begin (R84): the first statement of a delivery transaction. Makes the server end
-- this transaction (and its session) when it stays idle longer than the bound, so a relay that
-- goes silent never pins its rows; SET LOCAL semantics, so it ends with the transaction and
-- is safe behind a transaction-pooling proxy.
-- Parameters: $1 text the timeout in milliseconds (e.g. '5000').
-- Returns one row, one column (the setting).
SELECT set_config('idle_in_transaction_session_timeout', $1::text, true)
