-- The console's overview (relay.console.overview), read from indexes only.

-- name: overview_outbox
SELECT (SELECT count(*) FROM outbox WHERE status = 'pending'),
       (SELECT count(*) FROM outbox WHERE status = 'dead'),
       (SELECT extract(epoch FROM now() - created_at)::float8
          FROM outbox WHERE status = 'pending' ORDER BY seq LIMIT 1)

-- name: overview_outbox_rate
SELECT floor(extract(epoch FROM now() - published_at) / 60)::int, count(*)
FROM outbox WHERE status = 'published' AND published_at > now() - interval '60 minutes'
GROUP BY 1

-- name: overview_inbox_pending
SELECT consumer, count(*) FROM inbox WHERE status = 'pending' GROUP BY consumer

-- name: overview_inbox_dead
SELECT consumer, count(*) FROM inbox WHERE status = 'dead' GROUP BY consumer

-- name: overview_inbox_oldest
SELECT extract(epoch FROM now() - received_at)::float8 FROM inbox
WHERE consumer = :consumer AND status = 'pending' ORDER BY seq LIMIT 1

-- name: overview_inbox_rate
SELECT consumer, floor(extract(epoch FROM now() - processed_at) / 60)::int, count(*)
FROM inbox WHERE status = 'processed' AND processed_at > now() - interval '60 minutes'
GROUP BY 1, 2
