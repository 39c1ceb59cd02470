-- restore_timeout (R181): puts back the statement_timeout in force before the handler run.
-- Parameters: $1 text the setting statement_timeout returned.
SELECT set_config('statement_timeout', $1::text, true)
