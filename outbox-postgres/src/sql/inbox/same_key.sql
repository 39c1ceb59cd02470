-- same_key (R143): the row `e` is of @'s inbox key (consumer_group, source, partition_key), the
-- first column compared with `= ANY(ARRAY[...])`: the shared fragments' `same_key` for the inbox
-- table (see it).
e.consumer_group = ANY(ARRAY[@.consumer_group]) AND e.source = @.source
AND e.partition_key = @.partition_key
