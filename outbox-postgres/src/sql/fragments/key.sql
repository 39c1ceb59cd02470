-- key: @'s key as a column list, the leading columns of idx_<t>_pending_key_order: for the
-- outbox (topic, partition_key). The inbox table supplies its own (src/sql/inbox/key.sql)
-- through `expand_with`.
@.topic, @.partition_key
