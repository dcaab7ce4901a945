-- relay schema, version 8: a transaction can insert inbox rows without
-- waking the dispatchers. `relay inbox` stores most received messages
-- already processed, their handlers run in the transaction that inserts
-- them (docs/inbox.md, "Handling in the receiving transaction"): there is
-- nothing for a dispatcher to do, and a notification at every commit would
-- make PostgreSQL take its cluster-wide notify lock there, one committing
-- transaction at a time. Such a transaction sets relay.quiet to on (with
-- set_config(..., true): for itself only) and, when it does store a row
-- for the dispatchers, notifies them itself (the notify_wake query).
CREATE OR REPLACE FUNCTION relay_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    channel text := TG_ARGV[0];
BEGIN
    IF current_setting('relay.quiet', true) = 'on' THEN
        RETURN NULL;
    END IF;
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
