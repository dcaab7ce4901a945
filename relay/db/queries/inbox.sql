-- The inbox daemon's queries: the receiver's INSERT (relay.db.writer, in
-- the receiver's process, through plain psycopg) and the dispatchers'
-- claim and marks (relay.db.store).

-- name: inbox_insert
-- One statement per received batch, which travels as one JSON array of
-- objects (a text array per column cost the receiver much of its CPU in
-- psycopg's array quoting; docs/performance.md). Duplicates (same consumer
-- and producer id, in the table or earlier in the batch) are skipped;
-- RETURNING tells which rows are new. A raw body (not JSON) comes
-- base64-encoded.
INSERT INTO inbox (consumer, message_id, topic, key, type, payload, body, headers,
                   status, last_error, raw_properties)
SELECT :consumer, m.message_id, m.topic, m.key, m.type, m.payload,
       decode(m.body, 'base64'), m.headers, m.status, m.last_error,
       CAST(m.raw_properties AS json)
FROM json_to_recordset(CAST(:rows AS json))
     AS m(message_id text, topic text, key text, type text, payload jsonb, body text,
          headers jsonb, status text, last_error text, raw_properties text)
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING message_id

-- name: inbox_insert_received
-- The receiving transaction's INSERT (--dispatch received, relay.inbox
-- Dispatcher.receive): inbox_insert's rows, where a row that comes as
-- `processed` is stored so, to be handled in this transaction, unless its
-- key has a row waiting for the dispatchers ({held}: pending, and under
-- --on-dead block dead too), which it then waits behind as `pending`. The
-- statement's snapshot does not see its own rows: a batch's rows of one
-- key get one answer. The key's advisory lock, taken before, makes a
-- receiving transaction of another process on the key wait for this one.
--
-- The rows come with the `seq` values reserved for them in arrival order
-- (inbox_reserve_seqs, at :since), unless the part is late: another
-- transaction, holding a key of the part's (:keys) after the reservation,
-- has handled a row of it numbered after the part's first (:low). Such a
-- row was numbered after :since and processed in a transaction begun
-- later still (its processed_at), so the look is a short walk of the rows
-- processed since. A late part's rows are numbered anew here, in order,
-- after every row of its keys, as the order its handlers run in. (A row of
-- the part's keys left pending there is found by {held} instead: this
-- part waits behind it, and the dispatchers go by `seq`.)
INSERT INTO inbox (consumer, message_id, topic, key, type, payload, body, headers,
                   status, last_error, raw_properties, processed_at, seq)
SELECT :consumer, m.message_id, m.topic, m.key, m.type, m.payload,
       decode(m.body, 'base64'), m.headers, s.status, m.last_error,
       CAST(m.raw_properties AS json), CASE WHEN s.status = 'processed' THEN now() END,
       CASE WHEN late.late THEN nextval(pg_get_serial_sequence('inbox', 'seq')) ELSE m.seq END
FROM (
    SELECT EXISTS (
        SELECT 1 FROM inbox e
        WHERE e.status = 'processed' AND e.processed_at >= CAST(:since AS timestamptz)
        AND e.consumer = :consumer AND e.seq > :low
        AND e.key = ANY(ARRAY(SELECT json_array_elements_text(CAST(:keys AS json))))
    ) AS late
) AS late
CROSS JOIN json_to_recordset(CAST(:rows AS json))
     AS m(message_id text, topic text, key text, type text, payload jsonb, body text,
          headers jsonb, status text, last_error text, raw_properties text, seq bigint)
CROSS JOIN LATERAL (
    SELECT CASE WHEN m.status <> 'processed' THEN m.status
                WHEN m.key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM inbox e
                    WHERE e.consumer = :consumer AND e.key = m.key AND {held})
                THEN 'pending'
                ELSE 'processed' END) AS s(status)
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING message_id, status

-- name: inbox_reserve_seqs
-- A received batch's `seq` values, taken before its parts are stored side
-- by side (relay.inbox.Handing), so that `seq` keeps the order of arrival,
-- and the time the statement began (inbox_insert_received's :since).
SELECT nextval(pg_get_serial_sequence('inbox', 'seq')), statement_timestamp()
FROM generate_series(1, :count) ORDER BY 1

-- name: inbox_held_skip
e.status = 'pending'

-- name: inbox_held_block
e.status <> 'processed'

-- name: inbox_hold
-- Rows stored `processed` by the receiving transaction whose handler did not
-- run (an earlier row of their key failed in it): pending, for the dispatchers.
UPDATE inbox SET status = 'pending', processed_at = NULL
WHERE consumer = :consumer
AND message_id = ANY(ARRAY(SELECT json_array_elements_text(CAST(:ids AS json))))

-- name: inbox_claim
-- The inbox twin of the outbox claim (see outbox_claim), per consumer,
-- bounded by :budget bytes in the same way. A row is not claimed behind an
-- earlier row of its key that failed (attempts > 0: retried after a backoff,
-- or due again and to run first, alone), found in inbox_retrying_key, which
-- holds only such rows (relay delays an inbox row only when it fails). A
-- claimed row is `blocked` behind an earlier unfinished row of its key that
-- this claim did not lock (another dispatcher's): found once a key, by the
-- first such row (`held`), not by a walk of the key's rows for every row.
WITH low AS MATERIALIZED (
    SELECT coalesce(min(seq), 0) AS seq FROM inbox
    WHERE consumer = :consumer AND status = 'pending'
), locked AS (
    SELECT i.message_id, i.seq, i.topic, i.key, i.type, i.payload, i.headers, i.attempts
    FROM inbox i
    WHERE i.consumer = :consumer AND i.status = 'pending' AND i.seq >= (SELECT seq FROM low)
      AND (hashtext(coalesce(i.key, i.message_id)) & 2147483647)
          >= (CAST(:worker AS bigint) << 31) / :workers
      AND (hashtext(coalesce(i.key, i.message_id)) & 2147483647)
          < ((CAST(:worker AS bigint) + 1) << 31) / :workers
      AND i.available_at <= now()
      AND (i.key IS NULL OR (
          NOT EXISTS (
              SELECT 1 FROM inbox e
              WHERE e.consumer = i.consumer AND e.key = i.key AND e.seq < i.seq
                AND e.status = 'pending' AND e.attempts > 0)
          {dead}))
    ORDER BY i.seq
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), held AS MATERIALIZED (  -- once, whatever plan the joins get
    SELECT k.key, (
        SELECT min(e.seq) FROM inbox e
        WHERE e.consumer = :consumer AND e.key = k.key
          AND e.seq >= (SELECT seq FROM low) AND e.seq < k.last
          AND e.status <> 'processed' AND e.status <> 'dead'
          AND e.message_id NOT IN (SELECT message_id FROM locked)) AS seq
    FROM (SELECT key, max(seq) AS last FROM locked WHERE key IS NOT NULL GROUP BY key) k
), stored AS (
    -- A body that is not JSON has no payload (0 here): its bytes are read
    -- only for a retried row's handler, one row at a time (inbox_body).
    SELECT l.*, sum(coalesce(pg_column_size(l.payload), 0)) OVER w
                - coalesce(pg_column_size(l.payload), 0) AS before,
           row_number() OVER w AS rn
    FROM locked l WINDOW w AS (ORDER BY l.seq ROWS UNBOUNDED PRECEDING)
), sized AS (
    SELECT s.*, sum(s.size) OVER w AS upto, row_number() OVER w AS nth
    FROM (SELECT t.*, coalesce({size}, 0) AS size FROM stored t WHERE t.before <= :budget OR t.rn <= 2) s
    WINDOW w AS (ORDER BY s.seq ROWS UNBOUNDED PRECEDING)
)
SELECT l.message_id, l.seq, l.topic, l.key, l.type,
       CASE WHEN l.upto <= :budget OR (l.nth = 1 AND CAST(:alone AS int) = 1)
            THEN l.payload::text END AS payload,
       l.headers::text AS headers, l.attempts, l.size,
       l.upto <= :budget OR (l.nth = 1 AND CAST(:alone AS int) = 1) AS fits,
       coalesce(h.seq < l.seq, false) AS blocked
FROM sized l LEFT JOIN held h ON h.key = l.key
-- The rows that fit, and the first that does not (the one before it fits).
WHERE l.nth = 1 OR l.upto - l.size <= :budget OR (l.nth = 2 AND CAST(:alone AS int) = 1)
ORDER BY l.seq

-- name: inbox_claim_dead_skip
-- --on-dead skip: a dead row holds nothing back (an empty condition).

-- name: inbox_claim_dead_block
-- --on-dead block: a dead row holds back every later row of its key.
AND NOT EXISTS (
              SELECT 1 FROM inbox d
              WHERE d.consumer = i.consumer AND d.key = i.key AND d.seq < i.seq
                AND d.status = 'dead')

-- name: inbox_mark_processed
-- The ids travel as one JSON array: a text[] parameter costs the dispatcher
-- psycopg's array quoting of every id.
UPDATE inbox SET status = 'processed', processed_at = now(), last_error = NULL
WHERE consumer = :consumer
AND message_id = ANY(ARRAY(SELECT json_array_elements_text(CAST(:ids AS json))))

-- name: inbox_mark_failed
UPDATE inbox AS i SET
    attempts = i.attempts + 1,
    last_error = f.error,
    processed_at = NULL,  -- a row the receiving transaction stored processed
    available_at = now() + make_interval(secs => f.delay),
    status = CASE WHEN f.permanent OR i.attempts + 1 >= :max_attempts
                  THEN 'dead' ELSE 'pending' END
FROM unnest(CAST(:ids AS text[]), CAST(:errors AS text[]),
            CAST(:delays AS float8[]), CAST(:permanent AS bool[]))
     AS f(id, error, delay, permanent)
WHERE i.consumer = :consumer AND i.message_id = f.id
RETURNING i.message_id, i.status

-- name: inbox_body
-- A retried row whose body was not JSON: its handler gets the raw bytes too.
SELECT body FROM inbox WHERE consumer = :consumer AND message_id = :id

-- name: terminate_backend
-- The dispatcher's watchdog: end the transaction of a hung handler (its row
-- locks go with it) so its failed attempt can be recorded. Only ever given
-- the pid of the dispatcher's own connection.
SELECT pg_terminate_backend(:pid)

-- name: inbox_mark_hung
UPDATE inbox SET
    attempts = attempts + 1,
    last_error = :error,
    available_at = now() + make_interval(secs => :delay),
    status = CASE WHEN attempts + 1 >= :max_attempts THEN 'dead' ELSE 'pending' END
WHERE consumer = :consumer AND message_id = :id AND status = 'pending' AND attempts = :attempts
RETURNING status

-- name: lock_timeout
SELECT set_config('lock_timeout', :timeout, true)
