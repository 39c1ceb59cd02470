-- window: an unlocked pending row with attempts left, the predicate of the additive index
-- idx_<t>_pending_window (scheduled_at, created_at, id), whose order is the fetch window's
-- ORDER BY. Written with the "C" collation like `pending`, so this is the only index whose
-- predicate the window implies: the window is one ordered index read, bounded by its LIMIT,
-- whatever the statistics say (never a sort of the backlog).
@.status COLLATE "C" = 'pending' AND @.locked_at IS NULL AND @.attempts_made < @.max_attempts
