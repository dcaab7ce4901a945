-- relay schema, version 3: a backlog's millionth message costs what its
-- first did (issue 24; what was measured is in docs/backlog.md).
--
-- The pending index also holds each row's share: the hash that splits the
-- keys between a relay's workers (keyless rows are spread by their id). A
-- worker's claim walks the pending rows from the lowest one, and the rows
-- of the other workers' keys that lie ahead of it (a worker with more keys
-- falls behind the others all through a backlog) are now passed over in
-- the index instead of being read from the table one by one.
CREATE INDEX IF NOT EXISTS outbox_pending_share
    ON outbox (seq, (hashtext(coalesce(key, id::text)) & 2147483647))
    WHERE status = 'pending';
DROP INDEX IF EXISTS outbox_pending_seq;
CREATE INDEX IF NOT EXISTS inbox_pending_share
    ON inbox (consumer, seq, (hashtext(coalesce(key, message_id)) & 2147483647))
    WHERE status = 'pending';
DROP INDEX IF EXISTS inbox_pending_seq;

-- Every message leaves a dead row version and dead index entries behind it
-- (pending -> published/processed cannot be a HOT update: status is in the
-- partial indexes' predicates). PostgreSQL's defaults vacuum a table once a
-- fifth of it is dead: for a table holding a day of finished rows, millions
-- of dead versions, which the claim's look for the lowest pending row walks
-- over. These vacuum after 2 per cent of the table plus 10,000 rows, and let
-- the vacuum spend ten times the default cost budget so that it keeps up
-- with a backlog. Storage parameters only: no rewrite.
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_limit = 2000
);
ALTER TABLE inbox SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_limit = 2000
);
