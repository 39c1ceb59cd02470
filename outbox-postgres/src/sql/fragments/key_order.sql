-- key_order: a pending row, written exactly as the predicate of idx_<t>_pending_key_order
-- (R33), for the reads that walk a key's line in that index's order (the earlier-row probe,
-- the runs, the key walk) and name the key in its index condition.
@.status = 'pending'
