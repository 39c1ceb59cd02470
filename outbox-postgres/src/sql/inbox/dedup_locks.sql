-- dedup_locks (R111, R185 step 2, R189): dedup_lock.sql's advisory locks of several dedup keys,
-- taken in ascending order of (hashtext(message_id), hashtext(consumer_group)), so that two
-- transactions that share keys (a runner's batch before its landing, a processor's T_b before
-- its first run) wait in one order and never deadlock on them. A runner's batch locks the keys
-- already stored too: a lock it does not need costs a wait, never an order.
-- Parameters: $1 text[] message_id, $2 text[] consumer_group, pairwise.
-- Returns one row per distinct key (nothing to read).
SELECT pg_advisory_xact_lock(k.m, k.g)
  FROM (SELECT DISTINCT hashtext(u.m) AS m, hashtext(u.g) AS g
          FROM unnest($1::text[], $2::text[]) AS u(m, g)
         ORDER BY 1, 2) k
