-- Settings and savepoints of relay's own connections (relay.db.store,
-- relay.db.session, relay.db.connect).

-- name: backend_pid
-- The pid of the server process that answers (relay.db.connect: a pooler
-- gives its clients a made-up one).
SELECT pg_backend_pid()

-- name: plan_claim
-- Without statistics (a table bulk-loaded a moment ago, autovacuum off) the
-- planner may sort every pending row before the LIMIT, or probe each key
-- with a full scan; walking the seq index and probing the per-key indexes is
-- right at any size. (The probes spell "pending" as "neither finished nor
-- dead" so that only the per-key indexes match them.) SET LOCAL ends with
-- the transaction; the outbox workers' connections set them for the session.
-- (jit too, which the session options turn off, but not behind a pooler.)
SET LOCAL jit = off; SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off

-- name: unplan_claim
-- Handlers share the inbox claim's transaction: the default planner for them.
SET LOCAL enable_sort = on; SET LOCAL enable_bitmapscan = on; SET LOCAL enable_seqscan = on

-- name: plan_marks
-- The inbox's marks find their rows by the primary key (consumer,
-- message_id). psycopg prepares a statement on its fifth run, and the
-- server then keeps a generic plan, made for the table as it was: a plan
-- made while the table held a few rows matches the consumer in the index
-- and filters the ids row by row, and a statement prepared that early
-- walked every row of its consumer in each batch until
-- an ANALYZE, which never comes with autovacuum off. A plan made for the
-- table as it is at each run costs a fraction of a millisecond a batch.
-- SET LOCAL: it ends with the batch's transaction.
SET LOCAL plan_cache_mode = force_custom_plan

-- name: savepoint_batch_set
SAVEPOINT relay_batch

-- name: savepoint_batch_move
RELEASE SAVEPOINT relay_batch; SAVEPOINT relay_batch

-- name: savepoint_batch_undo
ROLLBACK TO SAVEPOINT relay_batch

-- name: savepoint_batch_release
RELEASE SAVEPOINT relay_batch

-- name: savepoint_handler_set
SAVEPOINT relay_handler

-- name: savepoint_handler_move
RELEASE SAVEPOINT relay_handler; SAVEPOINT relay_handler

-- name: savepoint_handler_undo
ROLLBACK TO SAVEPOINT relay_handler

-- name: savepoint_handler_release
RELEASE SAVEPOINT relay_handler

-- name: ping
-- The readiness probe: answers, and takes writes (a failover's demoted
-- writer or a standby answers read only).
SELECT current_setting('transaction_read_only')

-- name: notify
SELECT pg_notify(:channel, :payload)
