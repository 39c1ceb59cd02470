-- dedup_lock (R111, R152, R164): the dedup key's advisory lock on the partitioned table, with
-- exactly omni-box 0.3.1's arguments, so that landings of both libraries wait for each other.
-- Parameters: $1 text message_id, $2 text consumer_group.
SELECT pg_advisory_xact_lock(hashtext($1::text), hashtext($2::text))
