-- same_key: the row `e` is of @'s key, for the outbox (topic, partition_key), every column of
-- the key in idx_<t>_pending_key_order's index condition (so the descent starts and stops at
-- the key). The first column is compared with `= ANY(ARRAY[...])`, an equality to the planner's
-- estimates and to the index, but not one that makes the column a constant for the planner's
-- orders: a read of the key's line ordered by (`key_first`, created_at) then keeps an order
-- that only that index yields (see `earlier`). The inbox table supplies its own
-- (src/sql/inbox/same_key.sql) through `expand_with`.
e.topic = ANY(ARRAY[@.topic]) AND e.partition_key = @.partition_key
