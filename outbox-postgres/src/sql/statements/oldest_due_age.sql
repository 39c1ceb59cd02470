-- oldest_due_age (R80, R85): the age of the oldest due pending row.
--
-- No parameters. Returns one row, one column age_us int8: microseconds between now() and the
-- earliest scheduled_at of a due pending row, NULL when there is none.
--
-- Two index reads: the earliest due unlocked row (one row of idx_<t>_pending_window) and the
-- earliest due row among the locked ones (idx_<t>_locked_at: as many rows as are leased). The
-- second reads locked rows with a range condition on locked_at (every lock time is after
-- -infinity) rather than `locked_at IS NOT NULL`: without statistics the planner takes
-- IS NOT NULL to hold for 99.5 % of rows and would scan the table instead of the index.
SELECT (EXTRACT(EPOCH FROM (now() - min(m.s))) * 1000000)::int8 AS age_us
  FROM (
       (SELECT u.scheduled_at AS s
          FROM {table} u
         WHERE {window:u} AND u.scheduled_at <= now()
         ORDER BY u.scheduled_at
         LIMIT 1)
       UNION ALL
       (SELECT l.scheduled_at
          FROM {table} l
         WHERE l.locked_at > '-infinity'::timestamptz AND {pending:l} AND l.scheduled_at <= now()
         ORDER BY l.scheduled_at
         LIMIT 1)
  ) m
