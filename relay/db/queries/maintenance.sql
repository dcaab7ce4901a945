-- The daemons' scheduled jobs (relay.db.jobs): retention and gauges.

-- name: retention_lock
-- Only one replica deletes at a time: an advisory lock per table.
SELECT pg_try_advisory_xact_lock(:id)

-- name: delete_expired_outbox
-- Small batches keep each delete's locks and WAL short. The outer status
-- check is read again on a row changed since the statement began: a row a
-- replay (relay.replay) made pending meanwhile is kept.
DELETE FROM outbox WHERE id IN (SELECT id FROM outbox
WHERE status = 'published' AND published_at < now() - make_interval(secs => :age)
LIMIT :limit) AND status = 'published'

-- name: delete_expired_inbox
DELETE FROM inbox WHERE (consumer, message_id) IN (SELECT consumer, message_id
FROM inbox WHERE status = 'processed' AND processed_at < now() - make_interval(secs => :age)
LIMIT :limit) AND status = 'processed'

-- name: pending_gauge_outbox
SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
FROM outbox WHERE status = 'pending'

-- name: pending_gauge_inbox
SELECT count(*), coalesce(extract(epoch FROM now() - min(received_at)), 0)::float8
FROM inbox WHERE status = 'pending'

-- name: table_health
-- The table's dead row versions and its last vacuum (manual or auto), from
-- PostgreSQL's cumulative statistics: no scan of the table. Operators watch
-- these to see a backlog's churn outrun autovacuum (docs/backlog.md).
SELECT n_dead_tup,
coalesce(extract(epoch FROM greatest(last_vacuum, last_autovacuum)), 0)::float8
FROM pg_stat_user_tables WHERE relid = to_regclass(:table)

-- name: vacuum_outbox
-- relay's own vacuum of its table under churn (relay.maintenance.Vacuums):
-- outside a transaction; SKIP_LOCKED, so that it never waits behind
-- autovacuum or another replica's vacuum of the same table (a WARNING with
-- SQLSTATE 55P03 says it skipped).
VACUUM (SKIP_LOCKED) outbox

-- name: vacuum_inbox
VACUUM (SKIP_LOCKED) inbox
