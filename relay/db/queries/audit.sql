-- The audit trail (relay.audit): one row per write action, written in the
-- action's own transaction; read newest first.

-- name: audit_insert
INSERT INTO relay_audit (actor, via, action, target, filter, ids, count, before, after, detail)
VALUES (:actor, :via, :action, :target, CAST(:filter AS jsonb), CAST(:ids AS jsonb), :count,
        CAST(:before AS jsonb), CAST(:after AS jsonb), :detail)

-- name: audit_list
-- A page, newest first (keyset on id: below :before_id when given).
SELECT id, at, actor, via, action, target, filter::text, ids::text, count,
       before::text, after::text, detail
FROM relay_audit
WHERE CAST(:before_id AS bigint) IS NULL OR id < :before_id
ORDER BY id DESC
LIMIT :limit
