-- Capture from the WAL (relay.db.slot, `relay outbox --capture wal`;
-- docs/wal-capture.md). The slot and the publication share one name.

-- name: wal_settings
-- What a logical slot needs: wal_level = logical, and a role that may
-- replicate (the REPLICATION attribute, a superuser, or on RDS and Aurora
-- a member of rds_replication).
SELECT current_setting('wal_level') AS wal_level,
       current_user AS role,
       (SELECT r.rolreplication OR r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
       OR coalesce((SELECT pg_has_role(current_user, r.oid, 'member')
                    FROM pg_roles r WHERE r.rolname = 'rds_replication'), false) AS may_replicate,
       EXISTS (SELECT 1 FROM pg_settings WHERE name = 'rds.logical_replication') AS on_rds

-- name: wal_reader_lock
-- One reader per slot, across processes: a session advisory lock on the
-- slot's name (class "relw"), waited for no longer than the session's
-- lock_timeout (then lock_not_available and the stand-by asks again).
SELECT pg_advisory_lock(1919249527, hashtext(:slot))

-- name: wal_reader_unlock
SELECT pg_advisory_unlock(1919249527, hashtext(:slot))

-- name: wal_publication_exists
SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = :slot)

-- name: wal_slot
-- The slot as the server has it: missing (no row), or its plugin, database,
-- whether it is invalidated (wal_status lost), and its confirmed position.
SELECT plugin, database, wal_status, confirmed_flush_lsn::text
FROM pg_replication_slots WHERE slot_name = :slot AND slot_type = 'logical'

-- name: wal_create_slot
SELECT lsn::text FROM pg_create_logical_replication_slot(:slot, 'pgoutput')

-- name: wal_drop_slot
SELECT pg_drop_replication_slot(:slot)

-- name: wal_advance
-- The slot confirmed while no stream of relay's reads it (relay.db.stream
-- confirms by its status updates).
SELECT pg_replication_slot_advance(:slot, CAST(:lsn AS pg_lsn))

-- name: wal_lag
-- The WAL the slot holds back: the server's position less the slot's
-- confirmed one (restart_lsn may be further back; this is what relay moves).
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
FROM pg_replication_slots WHERE slot_name = :slot

-- name: wal_still_pending
-- Of the rows the slot delivered, those not yet published or dead.
SELECT id::text FROM outbox WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'pending'

-- name: wal_visible
-- Whether the transactions :xids (32-bit, from the slot) are visible to a
-- snapshot taken now. A commit is in the WAL a moment before the server
-- lets other sessions see it: a claim by id right after the read would not
-- find its rows yet. Visible: before the snapshot's xmax (modulo 2^32: the
-- xids are recent) and not among its running ones.
SELECT coalesce(bool_and(
           ((pg_snapshot_xmax(s)::text::bigint % 4294967296) - x + 4294967296) % 4294967296
               BETWEEN 1 AND 2147483647
           AND x <> ALL(ARRAY(SELECT v::text::bigint % 4294967296 FROM pg_snapshot_xip(s) v))),
       true)
FROM pg_current_snapshot() s, unnest(CAST(:xids AS bigint[])) x
