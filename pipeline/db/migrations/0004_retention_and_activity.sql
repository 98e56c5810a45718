-- Retention and per-consumer activity.
--
-- * attempts and audit_log get an index on their time column: the janitor deletes their
--   oldest rows in bounded batches, and `pipeline status` counts a consumer's failed
--   attempts of the last minutes, without scanning either table.
-- * delivery_log: one row per duplicate delivery a consumer acknowledged without running
--   its handler, and per delivery the ledger sweep sent again. Only those two (rare) paths
--   write it; `pipeline status` counts it per consumer and interval, and the janitor
--   deletes its rows with the attempt history.
CREATE INDEX attempts_occurred_idx ON attempts (occurred_at);
CREATE INDEX audit_log_at_idx ON audit_log (at);

CREATE TABLE delivery_log (
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    kind text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT delivery_log_kind_check CHECK (kind IN ('duplicate', 'redelivery'))
);
CREATE INDEX delivery_log_at_idx ON delivery_log (at);
