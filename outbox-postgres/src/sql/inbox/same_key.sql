-- same_key (R143): the probe row `e` is of @'s inbox key (consumer_group, source,
-- partition_key): the `earlier` fragment's key for the inbox table, whose equalities put the
-- key in idx_<p>_pending_key_order's index condition.
e.consumer_group = @.consumer_group AND e.source = @.source AND e.partition_key = @.partition_key
