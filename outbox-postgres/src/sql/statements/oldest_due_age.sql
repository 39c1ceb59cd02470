-- oldest_due_age (R80, R85): the age of the oldest due pending row.
--
-- No parameters. Returns one row, one column age_us int8: microseconds between now() and the
-- earliest scheduled_at of a due pending row, NULL when there is none.
--
-- Two index reads of one row each: the earliest due unlocked row (idx_<t>_pending_fetch) and
-- the earliest due row among the locked ones (idx_<t>_locked_at: as many rows as are leased).
SELECT (EXTRACT(EPOCH FROM (now() - min(m.s))) * 1000000)::int8 AS age_us
  FROM (
       (SELECT u.scheduled_at AS s
          FROM {table} u
         WHERE u.status = 'pending' AND u.locked_at IS NULL AND u.attempts_made < u.max_attempts
           AND u.scheduled_at <= now()
         ORDER BY u.scheduled_at
         LIMIT 1)
       UNION ALL
       (SELECT l.scheduled_at
          FROM {table} l
         WHERE l.locked_at IS NOT NULL AND l.status = 'pending' AND l.scheduled_at <= now()
         ORDER BY l.scheduled_at
         LIMIT 1)
  ) m
