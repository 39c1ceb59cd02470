-- land (R107, R109, R110): inserts one inbox row, or nothing when its dedup key (or id) is
-- already stored. A landing of a dedup key that another open transaction landed waits for it
-- (the unique index on the plain table; on the partitioned table the caller holds the dedup
-- key's advisory lock first, R111). created_at = scheduled_at = updated_at = one
-- clock_timestamp() (R103, R105); pending, no attempts, no lock, idempotency_key NULL.
-- Parameters: $1 uuid id, $2 text event_type, $3 text payload (JSON), $4 text[] headers
-- (JSON), $5 text[] trace_id, $6 text[] correlation_id, $7 text[] causation_id, $8 text[]
-- schema_version, $9 int4 max_attempts, $10 text message_id, $11 text consumer_group, $12 text
-- source, $13 text[] partition_key; each text[] one element, NULL when absent (a nullable
-- scalar, see driver::inbox).
-- Returns {columns} of the row inserted, or no row (then read it with by_message_id).
WITH c AS MATERIALIZED (SELECT clock_timestamp() AS ts)
INSERT INTO {table} ({columns})
SELECT $1::uuid, $2::text, $3::text::jsonb, ($4::text[])[1]::jsonb, ($5::text[])[1], NULL,
       ($6::text[])[1], ($7::text[])[1], ($8::text[])[1], 'pending', 0, $9::int4, NULL, c.ts,
       NULL, NULL, NULL, c.ts, c.ts, $10::text, $11::text, $12::text, ($13::text[])[1]
  FROM c
ON CONFLICT DO NOTHING
RETURNING {columns}
