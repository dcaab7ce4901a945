-- The one-shot commands' queries (relay.db.store.Store: `relay status`,
-- `relay retry`, the schema check) and the schema's own (relay.db.schema).

-- name: retry_outbox
UPDATE outbox SET status = 'pending', attempts = 0, available_at = now()
WHERE (id = ANY(CAST(:ids AS uuid[])) OR (:all_dead AND status = 'dead'))

-- name: retry_inbox
-- A claim check pointer (relay.claimcheck) whose object was not fetched
-- first (inbox_claim_checks) stays dead: a handler never sees the pointer.
UPDATE inbox SET status = 'pending', attempts = 0, available_at = now()
WHERE (message_id = ANY(:ids) OR (:all_dead AND status = 'dead'))
AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer)
AND NOT COALESCE(jsonb_typeof(payload) = 'array'
  AND payload ->> 0 IN ('software.amazon.payloadoffloading.PayloadS3Pointer',
                        'com.amazon.sqs.javamessaging.MessageS3Pointer')
  AND headers ?| ARRAY['ExtendedPayloadSize', 'SQSLargePayloadSize'], false)

-- name: inbox_claim_checks
-- The rows `relay retry` would retry that hold a claim check pointer
-- (kept as received when the object could not be read): fetched first.
SELECT consumer, message_id, CAST(payload AS text), CAST(headers AS text) FROM inbox
WHERE (message_id = ANY(:ids) OR (:all_dead AND status = 'dead'))
AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer)
AND COALESCE(jsonb_typeof(payload) = 'array'
  AND payload ->> 0 IN ('software.amazon.payloadoffloading.PayloadS3Pointer',
                        'com.amazon.sqs.javamessaging.MessageS3Pointer')
  AND headers ?| ARRAY['ExtendedPayloadSize', 'SQSLargePayloadSize'], false)
FOR UPDATE

-- name: inbox_claim_check_fetched
UPDATE inbox SET payload = CAST(:payload AS jsonb), headers = CAST(:headers AS jsonb)
WHERE consumer = :consumer AND message_id = :message_id

-- name: inbox_claim_check_unfetched
UPDATE inbox SET last_error = :error WHERE consumer = :consumer AND message_id = :message_id

-- name: notify_wake
-- A wake-up for the daemons (relay_outbox, relay_inbox), as a producer's commit
-- sends: on the channel of the schema :table is in, named as the trigger
-- names it (schema/006_schemas.sql, relay.db.namespace.channel).
SELECT pg_notify(CASE WHEN s.name IS NULL OR s.name = 'public' THEN :channel
                      WHEN octet_length(:channel || '.' || s.name) > 63
                      THEN :channel || '.' || md5(s.name)
                      ELSE :channel || '.' || s.name END, '')
FROM (SELECT (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE c.oid = to_regclass(:table))) AS s(name)

-- name: schema_table_exists
-- :table is relay_schema_version, schema-qualified under --schema.
SELECT to_regclass(:table) IS NOT NULL

-- name: schema_of
-- The schema a table (as the search_path finds it, or qualified) is in; NULL: none.
SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(:table)

-- name: schema_create
-- `relay schema apply --schema NAME`: :schema is a quoted identifier, checked
-- (relay.config.check_schema_name) and quoted (relay.db.namespace.quoted).
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: schema_version
SELECT max(version) FROM relay_schema_version

-- name: schema_apply_lock
SELECT pg_advisory_xact_lock(:id)

-- name: schema_version_table
CREATE TABLE IF NOT EXISTS relay_schema_version (
    version    int         PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: schema_versions_applied
SELECT version FROM relay_schema_version

-- name: schema_record_version
INSERT INTO relay_schema_version (version, name) VALUES (:v, :n)

-- name: status_counts_outbox
SELECT status, count(*) FROM outbox GROUP BY status

-- name: status_counts_inbox
SELECT status, count(*) FROM inbox GROUP BY status

-- name: oldest_pending_outbox
SELECT extract(epoch FROM now() - min(created_at))::float8
FROM outbox WHERE status = 'pending'

-- name: oldest_pending_inbox
SELECT extract(epoch FROM now() - min(received_at))::float8
FROM inbox WHERE status = 'pending'

-- name: dead_keys_outbox
-- Keys that have a dead row, which under --on-dead block holds back every
-- later row of the key: per table, and per consumer for the inbox; the
-- first :limit keys (oldest dead row first) and how many there are.
SELECT NULL::text AS consumer, key, count(*) OVER () AS total
FROM (SELECT key, min(seq) AS first FROM outbox
      WHERE status = 'dead' AND key IS NOT NULL GROUP BY key) d
ORDER BY first
LIMIT :limit

-- name: dead_keys_inbox
SELECT consumer, key, total FROM (
    SELECT consumer, key, count(*) OVER (PARTITION BY consumer) AS total,
           row_number() OVER (PARTITION BY consumer ORDER BY first) AS n
    FROM (SELECT consumer, key, min(seq) AS first FROM inbox
          WHERE status = 'dead' AND key IS NOT NULL GROUP BY consumer, key) d
) t
WHERE n <= :limit
ORDER BY consumer, n
