-- relay schema, version 7: the inbox's claim asks "did an earlier row of
-- this key fail?" of an index that holds only the rows that failed and wait
-- for their retry (relay delays an inbox row only when its handler fails:
-- attempts > 0). The claim walked every earlier unfinished row of the key
-- in the table for that, twice a row; this index is empty while nothing
-- fails (docs/inbox.md, "The claim"). Building it reads the whole table
-- while writes to it wait: on a large inbox, create it beforehand with
-- CREATE INDEX CONCURRENTLY (same name and definition), which this finds.
CREATE INDEX IF NOT EXISTS inbox_retrying_key
    ON inbox (consumer, key, seq)
    WHERE status = 'pending' AND attempts > 0;
