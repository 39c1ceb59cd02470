-- key_lock (R116): the inbox key's lock, a transaction-scoped advisory lock on a 64-bit hash
-- of (consumer_group, source, partition_key) (the one-key form).
-- Parameters: $1 text consumer_group, $2 text source, $3 text partition_key.
SELECT pg_advisory_xact_lock(hashtextextended(json_build_array($1::text, $2::text, $3::text)::text, 0))
