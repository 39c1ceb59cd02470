-- drained (the relay binary's drain check): no pending row is held (by any relay, expired
-- leases included), and no row is a due head: pending, due, attempts left, and no earlier row
-- of its key in line (due, tried or held; `in_line`). One statement, so one snapshot: a fetch
-- of another relay between two reads cannot make a busy table look drained.
--
-- No parameters. Returns one row, one column drained bool.
SELECT NOT EXISTS (SELECT 1 FROM {table} l WHERE {key_order:l} AND l.locked_at IS NOT NULL)
   AND NOT EXISTS (SELECT 1
                     FROM {table} h
                    WHERE {key_order:h} AND h.scheduled_at <= now()
                      AND h.attempts_made < h.max_attempts
                      AND NOT EXISTS ({earlier:h}))
       AS drained
