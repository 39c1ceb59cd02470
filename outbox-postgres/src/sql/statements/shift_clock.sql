-- Test clock (the conformance harness's "advance"): $1 int8 microseconds. Moves created_at,
-- scheduled_at, locked_at, completed_at and updated_at of every row back by that much.
UPDATE {table} SET
    created_at = created_at - $1::int8 * INTERVAL '1 microsecond',
    scheduled_at = scheduled_at - $1::int8 * INTERVAL '1 microsecond',
    locked_at = locked_at - $1::int8 * INTERVAL '1 microsecond',
    completed_at = completed_at - $1::int8 * INTERVAL '1 microsecond',
    updated_at = updated_at - $1::int8 * INTERVAL '1 microsecond'
