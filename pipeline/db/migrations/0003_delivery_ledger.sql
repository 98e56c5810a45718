-- The delivery ledger: Postgres, not Redis, knows what every consumer is still owed.
--
-- * outbox.consumers: the consumers an event was delivered to, set in the statement that
--   marks it sent. For each of them the inbox row (consumer, event_id) tells whether the
--   event was processed, dead-lettered, or is still owed.
-- * inbox.delivered_at: when a copy of the event was last handed to the broker for this
--   consumer (or when its retry is due); inbox.redeliveries: how often the ledger sweep
--   sent it again because no outcome arrived within the redelivery horizon.
-- * delivery_sweep: how far the sweep has looked at sent events (one row).
--
-- now() (not clock_timestamp()) as the first default, so that adding the column does not
-- rewrite the table; new rows take the exact time.
ALTER TABLE outbox ADD COLUMN consumers text[];

ALTER TABLE inbox ADD COLUMN delivered_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE inbox ALTER COLUMN delivered_at SET DEFAULT clock_timestamp();
ALTER TABLE inbox ADD COLUMN redeliveries integer NOT NULL DEFAULT 0;
-- The sweep finds owed deliveries (unfinished, delivered longer ago than the horizon)
-- here; processed rows never enter this index, so consumers pay nothing for it.
CREATE INDEX inbox_owed_idx ON inbox (delivered_at) WHERE status IN ('pending', 'failed');

CREATE TABLE delivery_sweep (
    id boolean PRIMARY KEY DEFAULT true,
    swept_to timestamptz NOT NULL DEFAULT clock_timestamp(),
    sweeps bigint NOT NULL DEFAULT 0,
    CONSTRAINT delivery_sweep_one_row CHECK (id)
);
INSERT INTO delivery_sweep DEFAULT VALUES;
