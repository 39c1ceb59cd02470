-- due (R20, R21): a pending row that may be handed out now: its time has come, it has attempts
-- left and no live lease holds it (its status is checked by the caller: {pending:@} or
-- {window:@}).
@.scheduled_at <= now() AND @.attempts_made < @.max_attempts AND {lease_free:@}
