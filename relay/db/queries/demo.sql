-- `relay demo` (relay.demo): the demo's own table and queries (an app's,
-- not relay's).

-- name: demo_lock
-- Serializes concurrent `relay demo` start-ups.
SELECT pg_advisory_xact_lock(:id)

-- name: demo_create_table
CREATE TABLE IF NOT EXISTS relay_demo_events (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    key         text        NULL,
    n           bigint      NULL,
    traceparent text        NULL,
    handled_at  timestamptz NOT NULL DEFAULT now(),
    -- each consumer handles each message once: a second run would fail here
    PRIMARY KEY (consumer, message_id)
)

-- name: demo_create_index
CREATE INDEX IF NOT EXISTS relay_demo_events_handled_at ON relay_demo_events (handled_at)

-- name: demo_insert_event
INSERT INTO relay_demo_events (consumer, message_id, key, n, traceparent)
VALUES (:consumer, :message_id, :key, :n, :traceparent)

-- name: demo_now
SELECT now()

-- name: demo_stats
-- Totals since the demo started, and the backlogs; partial indexes serve each.
SELECT
    (SELECT count(*) FROM outbox WHERE status = 'published' AND published_at >= :since),
    (SELECT count(*) FROM relay_demo_events
     WHERE handled_at >= :since AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer)),
    (SELECT count(*) FROM outbox WHERE status = 'pending'),
    (SELECT count(*) FROM inbox
     WHERE status = 'pending' AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer))
