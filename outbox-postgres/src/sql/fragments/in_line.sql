-- in_line (R27): the row stands in its key's line, so a later row of the key must wait for it:
-- it is due, or it was tried (a retry waits, R42), or it is held. A never-tried row scheduled
-- for later is out of line and passed over (R29).
(@.scheduled_at <= now() OR @.last_error IS NOT NULL OR @.locked_at IS NOT NULL)
