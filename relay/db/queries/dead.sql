-- The dead-message workflow (relay.dead, through relay.db.dead). These are
-- templates: relay.db.dead fills their {slots} with table and column names
-- from its fixed COLUMNS and with conditions whose values are bound
-- parameters (relay.db.dead.condition); never with input.

-- name: dead_error_line
-- The error group of a row: the exception's type and first line. A handler's
-- last_error is a Python traceback, whose summary is its last line
-- ("ValueError: boom"; of a chain, the last exception's); any other text is
-- grouped by its first line. String functions, not a regular expression:
-- a page groups thousands of rows. {t} is the table's alias.
(CASE WHEN {t}.last_error LIKE 'Traceback (most recent call last):%'
  THEN reverse(split_part(reverse(rtrim({t}.last_error, E' \n')), E'\n', 1))
  ELSE split_part(coalesce({t}.last_error, ''), E'\n', 1) END)

-- name: dead_list
-- One page of dead rows of a table, newest first (keyset on seq).
SELECT {ident}, {consumer}, d.seq, d.topic, d.key, d.type, d.attempts,
       {error_line}, {written}, d.available_at
FROM {table} d
WHERE {where} {after}
ORDER BY d.seq DESC
LIMIT :limit

-- name: dead_count
SELECT count(*) FROM (SELECT 1 FROM {table} d WHERE {where}{cap}) r

-- name: dead_groups
SELECT {error_line} AS error, count(*), max({written}) FROM {source} GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT :limit

-- name: dead_groups_newest
-- The rows a page's quick look groups: the newest of the table.
(SELECT d.last_error, {written} FROM {source} ORDER BY d.seq DESC LIMIT :newest) d

-- name: dead_get
SELECT {ident}, {consumer}, d.seq, d.topic, d.key, d.type, d.attempts, {error_line}, {written}, d.available_at, d.payload::text, d.headers::text, coalesce(d.last_error, ''), {extra} FROM {table} d WHERE d.status = 'dead' AND {match}{order}

-- name: dead_update
UPDATE {table} SET {sets} WHERE {match} AND status = 'dead'

-- name: dead_lock
SELECT {consumer}, {ident} FROM {table} d WHERE {where} FOR UPDATE

-- name: discard_outbox
-- A discard moves the rows whole into relay_discarded, in the caller's transaction.
WITH gone AS (
    DELETE FROM outbox WHERE status = 'dead' AND id = ANY(CAST(:ids AS uuid[])) RETURNING *)
INSERT INTO relay_discarded (source, message_id, consumer, row_data, reason)
SELECT 'outbox', gone.id::text, NULL, to_jsonb(gone), :reason FROM gone

-- name: discard_inbox
WITH gone AS (
    DELETE FROM inbox WHERE status = 'dead' AND consumer = :consumer
      AND message_id = ANY(CAST(:ids AS text[])) RETURNING *)
INSERT INTO relay_discarded (source, message_id, consumer, row_data, reason)
SELECT 'inbox', gone.message_id, gone.consumer, to_jsonb(gone), :reason FROM gone
