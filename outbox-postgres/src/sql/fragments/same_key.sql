-- same_key: the row `e` is of @'s key, for the outbox (topic, partition_key), written as two
-- inequalities per column rather than an equality. The planner's estimate of the key's rows is
-- the same, but an equality would make the key's columns constants for it, so that an ORDER BY
-- of idx_<t>_pending_key_order's columns would shrink to created_at, an order that
-- idx_<t>_created_at yields too (see `earlier`). The inbox table supplies its own
-- (src/sql/inbox/same_key.sql) through `expand_with`.
e.topic >= @.topic AND e.topic <= @.topic
AND e.partition_key >= @.partition_key AND e.partition_key <= @.partition_key
