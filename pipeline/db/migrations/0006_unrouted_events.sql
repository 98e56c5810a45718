-- Events sent to nobody: marked sent while no consumer subscribed to their type (the relay
-- records the consumers each event went to in outbox.consumers; here the list is empty).
-- The index finds them for `pipeline status` and `pipeline dlq unrouted` without scanning
-- the sent events, and holds no row while every event has a consumer.
CREATE INDEX outbox_unrouted_idx ON outbox (seq)
    WHERE status = 'sent' AND consumers = '{}'::text[];
