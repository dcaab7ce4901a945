-- The outbox daemon's queries (relay.db.session.OutboxSession, relay.db.store).
-- Placeholders are :name, everywhere in relay.db (relay.db.queries).

-- name: outbox_claim
-- Claim due outbox rows in seq order, keeping per-key order:
-- - the inner filter skips rows that wait behind an earlier row of their key
--   which is not due yet (backoff, delay), has failed before (a key whose
--   head failed goes head first and alone until the head is published or
--   dead) or, under --on-dead block, is dead;
-- - the outer filter marks rows `blocked` whose key has an earlier pending
--   row that another relay holds right now: they stay pending, and the
--   relay holding the key's head publishes them later.
-- The workers of one relay split the keys between them by ranges of their
-- hash (keyless rows by the hash of their id), so they never wait on each
-- other; the pending index holds that hash, so a worker passes over the
-- other workers' rows without reading them from the table. {dead} is the
-- --on-dead policy (outbox_claim_dead_*); :limit is the batch size,
-- :worker the worker and :workers how many there are.
--
-- The batch is bounded by bytes too (issue 43; docs/operations.md): of the
-- rows locked, in seq order, it takes those whose payloads' sizes add up to
-- at most :budget bytes, and a first row larger than that alone when
-- :alone is 1. PostgreSQL measures before anything is read: {size} is the
-- payload's size as text, the bytes the daemon will hold (claim_size in
-- relay.db.sql: pg_column_size for a value stored uncompressed, which reads
-- no more than the row or its TOAST pointer; for a compressed one the
-- text's length, never less than what is stored), and only rows whose
-- stored sizes so far are within the budget are measured (and the second,
-- which follows a first row taken alone): as no size is below the stored
-- one, the rows left out would not have fitted, and the first that does
-- not is always measured. The first row past the budget comes back too,
-- without its payload (fits false): its size tells the daemon how many
-- bytes it must wait for (relay.budget).
--
-- A claim runs under its share's lock, taken by the statement before it
-- (outbox_share_wait, outbox_shares_try); when the scout's try found a
-- share held elsewhere (relay.shares_busy, set for this transaction), the
-- claim takes nothing: a one-time filter, so not even `low` is read.
--
-- Every pending row has seq >= `low`, the lowest pending seq in the
-- statement's snapshot: the main scan and the per-key probes start there.
-- Without it, each probe walked its key's index entries from the first:
-- those of every row of the key finished since the last vacuum, dead but
-- still in the index, so a message cost more the more had gone before it
-- in a backlog (docs/backlog.md). Only `low` itself still walks the dead
-- entries left of the lowest pending row, once per claim.
WITH low AS MATERIALIZED (
    SELECT coalesce(min(seq), 0) AS seq FROM outbox WHERE status = 'pending'
), locked AS (
    SELECT o.id, o.seq, o.topic, o.key, o.type, o.payload, o.headers, o.created_at, o.attempts
    FROM outbox o
    WHERE current_setting('relay.shares_busy', true) IS DISTINCT FROM 'true'
      AND o.status = 'pending' AND o.seq >= (SELECT seq FROM low)
      AND (hashtext(coalesce(o.key, o.id::text)) & 2147483647)
          >= (CAST(:worker AS bigint) << 31) / :workers
      AND (hashtext(coalesce(o.key, o.id::text)) & 2147483647)
          < ((CAST(:worker AS bigint) + 1) << 31) / :workers
{tail}

-- name: outbox_claim_tail
-- The claims' common end (outbox_claim, outbox_claim_ids: their `{tail}`,
-- after the conditions of their own): the due rows whose key has no earlier
-- row held back, locked in seq order; then the locked rows measured against
-- the byte budget, and whether each is blocked behind an earlier pending
-- row of its key held elsewhere.
      AND o.available_at <= now()
      AND (o.key IS NULL OR (
          NOT EXISTS (
              SELECT 1 FROM outbox e
              WHERE e.key = o.key AND e.seq >= (SELECT seq FROM low) AND e.seq < o.seq
                AND e.status <> 'published' AND e.status <> 'dead'
                AND (e.available_at > now() OR e.attempts > 0))
          {dead}))
    ORDER BY o.seq
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), stored AS (
    SELECT l.*, sum(pg_column_size(l.payload)) OVER w - pg_column_size(l.payload) AS before,
           row_number() OVER w AS rn
    FROM locked l WINDOW w AS (ORDER BY l.seq ROWS UNBOUNDED PRECEDING)
), sized AS (
    SELECT s.*, sum(s.size) OVER w AS upto, row_number() OVER w AS nth
    FROM (SELECT t.*, {size} AS size FROM stored t WHERE t.before <= :budget OR t.rn <= 2) s
    WINDOW w AS (ORDER BY s.seq ROWS UNBOUNDED PRECEDING)
)
SELECT l.id::text AS id, l.seq, l.topic, l.key, l.type,
       CASE WHEN l.upto <= :budget OR (l.nth = 1 AND CAST(:alone AS int) = 1)
            THEN l.payload::text END AS payload,
       l.headers::text AS headers, l.created_at, l.attempts, l.size,
       l.upto <= :budget OR (l.nth = 1 AND CAST(:alone AS int) = 1) AS fits,
       l.key IS NOT NULL AND EXISTS (
           SELECT 1 FROM outbox e
           WHERE e.key = l.key AND e.seq >= (SELECT seq FROM low) AND e.seq < l.seq
             AND e.status <> 'published' AND e.status <> 'dead'
             AND e.id NOT IN (SELECT id FROM locked){before}) AS blocked
FROM sized l
-- The rows that fit, and the first that does not (the one before it fits).
WHERE l.nth = 1 OR l.upto - l.size <= :budget OR (l.nth = 2 AND CAST(:alone AS int) = 1)
ORDER BY l.seq

-- name: outbox_claim_ids
-- The claim of the rows the slot delivered (relay outbox --capture wal):
-- of :ids, those still pending and due, whose key has no earlier row held
-- back (the same filter as outbox_claim's, with the same `low` and {dead});
-- no walk through the pending rows and no share of the keys: it runs under
-- every share's lock (outbox_shares_try), as a scout's claim does.
WITH low AS MATERIALIZED (
    SELECT coalesce(min(seq), 0) AS seq FROM outbox WHERE status = 'pending'
), locked AS (
    SELECT o.id, o.seq, o.topic, o.key, o.type, o.payload, o.headers, o.created_at, o.attempts
    FROM outbox o
    WHERE current_setting('relay.shares_busy', true) IS DISTINCT FROM 'true'
      AND o.id = ANY(CAST(:ids AS uuid[]))
      AND o.status = 'pending'
{tail}

-- name: outbox_share_wait
-- A worker's share of the keys, for the rest of its transaction: one
-- advisory lock per share across every relay (relay.db.session's
-- SHARE_LOCK_CLASS and share_key), waited for in the queue behind the
-- worker of any relay that holds it, but no longer than :timeout (ms): then
-- lock_not_available, and the worker asks again (it may be stopping). The
-- claim after it, in the same round trip, takes its snapshot once the lock
-- is granted, so it sees the last holder's rows finished and none of its
-- keys' rows held. lock_timeout goes back to the session's before the claim
-- and the marks, which may wait behind DDL as they always did.
SELECT set_config('lock_timeout', CAST(:timeout AS text), true);
SELECT pg_advisory_xact_lock(:class, :share);
SET LOCAL lock_timeout TO DEFAULT

-- name: outbox_shares_try
-- The scout's (a claim of every key): the lock of each of :shares, none
-- waited for (the scout never waits, so it is never in a cycle of waits);
-- shares_busy (relay.shares_busy, for the transaction) tells the claim that
-- follows whether one of them is held elsewhere. The locks it did get
-- are released when the transaction ends.
SELECT set_config(
    'relay.shares_busy',
    CAST(NOT coalesce(bool_and(pg_try_advisory_xact_lock(:class, s)), true) AS text),
    true) AS shares_busy
FROM unnest(CAST(:shares AS int[])) AS s

-- name: outbox_shares_try_shared
-- The same tries as outbox_shares_try, of the shared locks: the WAL
-- reader's batches (relay outbox --capture wal), two of which are claimed
-- and published one behind the other, hold every share together, and so
-- exclude every claim worker (whose locks are exclusive) as one batch did.
SELECT set_config(
    'relay.shares_busy',
    CAST(NOT coalesce(bool_and(pg_try_advisory_xact_lock_shared(:class, s)), true) AS text),
    true) AS shares_busy
FROM unnest(CAST(:shares AS int[])) AS s

-- name: outbox_claim_before_none
-- (outbox_claim_tail's {before}: every claim but a WAL batch claimed behind another.)

-- name: outbox_claim_before_ids
-- A WAL batch claimed while the batch before it is out (relay.capture): the
-- earlier batch's rows (:before) hold back no row of this one, since this
-- one goes out only once that one went out whole.

             AND NOT (e.id = ANY(CAST(:before AS uuid[])))

-- name: outbox_claim_dead_skip
-- --on-dead skip: a dead row holds nothing back (an empty condition).

-- name: outbox_claim_dead_block
-- --on-dead block: a dead row holds back every later row of its key.
AND NOT EXISTS (
              SELECT 1 FROM outbox d
              WHERE d.key = o.key AND d.seq < o.seq AND d.status = 'dead')

-- name: outbox_mark_published
UPDATE outbox SET status = 'published', published_at = now(), last_error = NULL
WHERE id = ANY(:ids)

-- name: outbox_mark_failed
-- One statement for every failure of a batch. `permanent` rows (retrying
-- cannot help) go dead at once; the rest wait `delay` seconds.
UPDATE outbox AS o SET
    attempts = o.attempts + 1,
    last_error = f.error,
    available_at = now() + make_interval(secs => f.delay),
    status = CASE WHEN f.permanent OR o.attempts + 1 >= :max_attempts
                  THEN 'dead' ELSE 'pending' END
FROM unnest(CAST(:ids AS uuid[]), CAST(:errors AS text[]),
            CAST(:delays AS float8[]), CAST(:permanent AS bool[]))
     AS f(id, error, delay, permanent)
WHERE o.id = f.id
RETURNING o.id::text, o.status
