-- relay schema, version 6: relay's tables in a schema of their own
-- (`--schema NAME`), several in one database (a schema per tenant).
--
-- The notify trigger wakes only the relays of its own schema: it notifies
-- relay_outbox.<schema> (relay_inbox.<schema>), or relay_outbox.<md5 of the
-- schema> where that name would pass PostgreSQL's 63 bytes. Tables in
-- `public` keep the channels relay always used, relay_outbox and
-- relay_inbox, so relays of earlier versions keep their wake-ups there.
-- relay.db.namespace.channel and the notify_wake query name them the same.
CREATE OR REPLACE FUNCTION relay_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    channel text := TG_ARGV[0];
BEGIN
    IF TG_TABLE_SCHEMA <> 'public' THEN
        channel := TG_ARGV[0] || '.' || TG_TABLE_SCHEMA;
        IF octet_length(channel) > 63 THEN
            channel := TG_ARGV[0] || '.' || md5(TG_TABLE_SCHEMA);
        END IF;
    END IF;
    PERFORM pg_notify(channel, '');
    RETURN NULL;
END
$$;
