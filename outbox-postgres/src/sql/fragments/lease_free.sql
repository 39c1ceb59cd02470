-- lease_free (R19, R76): the row is not held under a live lease: never locked, or locked
-- longer ago than the lease TTL ({lease_us}, int8 microseconds). One comparison rather than
-- `locked_at IS NULL OR locked_at < ...`, so the planner never turns it into a bitmap OR over
-- the partial indexes.
COALESCE(@.locked_at, '-infinity'::timestamptz) < now() - {lease_us} * INTERVAL '1 microsecond'
