-- window_unlocked (R149, R20, R85): a fetchable row of the group {group} (of the sources
-- {sources}, NULL for all) that no lease holds: the fetch window's first range. Its predicate
-- {window:@} (written under the "C" collation) is the predicate of idx_<p>_pending_window
-- (consumer_group, scheduled_at, created_at, id) and of no other index, so the window is one
-- read of that index in its own order, stopped by the window's LIMIT, whatever the planner's
-- statistics say. (Without statistics the planner used to read the group's whole backlog from
-- idx_<p>_pending_group, ordered by scheduled_at only, and sort it.)
@.consumer_group = {group} AND {window:@} AND @.scheduled_at <= now()
AND ({sources} IS NULL OR @.source = ANY({sources}))
