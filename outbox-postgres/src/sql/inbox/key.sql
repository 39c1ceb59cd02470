-- key (R143): @'s inbox key as a column list, (consumer_group, source, partition_key), the
-- leading columns of idx_<p>_pending_key_order: the shared fragments' `key` for the inbox table.
@.consumer_group, @.source, @.partition_key
