-- same_key: the probe row `e` is of @'s key: for the outbox (topic, partition_key), whose
-- equalities put the key in idx_<t>_pending_key_order's index condition. The inbox table
-- supplies its own (src/sql/inbox/same_key.sql) through `expand_with`.
e.topic = @.topic AND e.partition_key = @.partition_key
