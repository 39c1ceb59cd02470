-- window_expired (R23, R149): a fetchable row of the group {group} (of the sources {sources},
-- NULL for all) under an expired lease: the fetch window's second range, rare, read from
-- idx_<p>_locked_at (a range on locked_at, as many rows as are leased). Written as a range
-- rather than `locked_at IS NOT NULL` and a lone `locked_at < ...`: without statistics the
-- first looks true of nearly every row, and in a generic plan (the TTL {lease_us} unknown) the
-- second of a third of the table; both would make a table scan look cheaper. {pending:@}
-- implies no partial index's predicate.
@.locked_at >= '-infinity'::timestamptz
AND @.locked_at < now() - {lease_us} * INTERVAL '1 microsecond'
AND {pending:@} AND @.consumer_group = {group} AND @.attempts_made < @.max_attempts
AND @.scheduled_at <= now() AND ({sources} IS NULL OR @.source = ANY({sources}))
