-- same_key (R143): the row `e` is of @'s inbox key (consumer_group, source, partition_key),
-- two inequalities per column: the shared fragments' `same_key` for the inbox table (see it).
e.consumer_group >= @.consumer_group AND e.consumer_group <= @.consumer_group
AND e.source >= @.source AND e.source <= @.source
AND e.partition_key >= @.partition_key AND e.partition_key <= @.partition_key
