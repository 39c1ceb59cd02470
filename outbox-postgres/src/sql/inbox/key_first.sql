-- key_first (R143): the first column of @'s inbox key, consumer_group, the leading column of
-- idx_<p>_pending_key_order: the shared fragments' `key_first` for the inbox table.
@.consumer_group
