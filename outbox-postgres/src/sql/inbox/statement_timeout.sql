-- statement_timeout (R181): bounds each statement of a handler run by the handler timeout
-- until the savepoint is rolled back to or released (set_config(..., true) is SET LOCAL).
-- Parameters: $1 text the timeout in milliseconds. Returns one row, one column text: the
-- setting before, to restore after a release.
SELECT current_setting('statement_timeout') AS before,
       set_config('statement_timeout', $1::text, true) AS now_set
