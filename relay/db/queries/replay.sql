-- Replay (relay.replay, through relay.db.replay): finished rows back to
-- pending. These are templates: relay.db.replay fills {where} with a
-- condition on alias `r` whose values are all bound parameters
-- (relay.db.replay.condition); never with input.

-- name: replay_count_outbox
SELECT count(*) FROM outbox r WHERE r.status = 'published' AND {where}

-- name: replay_count_inbox
SELECT count(*) FROM inbox r WHERE r.status = 'processed' AND {where}

-- name: replay_hold_outbox
-- The hold, on a connection of its own: the pending rows of every key the
-- replay touches, locked (waiting for the batches that hold them to end)
-- from before the replay commits until every claim that began before it has
-- ended. A claim reads the key's earlier rows in its statement's snapshot:
-- one that began before the commit would see the replayed rows still
-- published and take a later pending row of their key ahead of them; the
-- hold's locks make it skip that row instead (SKIP LOCKED).
SELECT p.id FROM outbox p
WHERE p.status = 'pending' AND p.key IN (
    SELECT r.key FROM outbox r WHERE r.status = 'published' AND r.key IS NOT NULL AND {where})
ORDER BY p.seq
FOR UPDATE OF p

-- name: replay_hold_inbox
SELECT p.message_id FROM inbox p
WHERE p.status = 'pending' AND (p.consumer, p.key) IN (
    SELECT r.consumer, r.key FROM inbox r
    WHERE r.status = 'processed' AND r.key IS NOT NULL AND {where})
ORDER BY p.consumer, p.seq
FOR UPDATE OF p

-- name: replay_outbox
-- The rows back to pending as new: attempts reset, due now, with their id
-- and seq (so in their key's order, ahead of the key's pending rows). A row
-- another transaction holds (a retention run deleting it, another replay)
-- is passed over; a row a batch is publishing is pending, not published,
-- and never matches.
WITH chosen AS (
    SELECT r.id FROM outbox r WHERE r.status = 'published' AND {where}
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE outbox o SET status = 'pending', attempts = 0, available_at = now(),
    last_error = NULL, published_at = NULL
FROM chosen WHERE o.id = chosen.id

-- name: replay_inbox
WITH chosen AS (
    SELECT r.consumer, r.message_id FROM inbox r WHERE r.status = 'processed' AND {where}
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE inbox i SET status = 'pending', attempts = 0, available_at = now(),
    last_error = NULL, processed_at = NULL
FROM chosen WHERE i.consumer = chosen.consumer AND i.message_id = chosen.message_id

-- name: replay_clock
SELECT clock_timestamp()

-- name: replay_older_statements
-- Statements of clients on this database that began before :since and
-- still run (the claims the hold waits out). Not those waiting for an
-- advisory lock: a worker waiting for its share's lock takes the claim's
-- snapshot only once it has it. Sessions of other users show no state to a
-- user without pg_read_all_stats and are not counted.
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND backend_type = 'client backend' AND state = 'active' AND query_start < :since
  AND wait_event IS DISTINCT FROM 'advisory'

-- name: replay_activity_fresh
-- pg_stat_activity is read once per transaction and kept: the hold polls
-- it inside its transaction, so it asks for a fresh look each time.
SELECT pg_stat_clear_snapshot()
