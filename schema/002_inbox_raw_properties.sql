-- relay schema, version 2: an inbox row keeps, losslessly, the properties of
-- a message that its columns could not hold as given (NUL characters,
-- invalid UTF-8, values past PostgreSQL's limits, an AMQP content header
-- that could not be decoded). JSON text, not jsonb: it keeps \u0000 escapes.
ALTER TABLE inbox ADD COLUMN IF NOT EXISTS raw_properties json NULL;
