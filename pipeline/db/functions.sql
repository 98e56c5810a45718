-- Repeatable objects (functions and triggers), re-applied whenever this file changes.
-- Runs with search_path set to the pipeline schema; :channel is the NOTIFY channel.

-- Wake the relay after an outbox insert, but only while no relay is busy: a busy relay
-- polls continuously, and skipping NOTIFY spares producers its database-wide commit lock.
-- The payload is constant so that all notifications of one transaction fold into one.
CREATE OR REPLACE FUNCTION notify_outbox() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM relay_state
        WHERE busy AND heartbeat_at > clock_timestamp() - interval '5 seconds'
    ) THEN
        PERFORM pg_notify(TG_ARGV[0], '');
    END IF;
    RETURN NULL;
END
$$;

-- Number ordered events under a per-key transaction lock, so that within one ordering key
-- sequence order is commit order: a committed event never has a higher seq than an event
-- of its key that is still to commit, and the relay can publish a key in seq order as soon
-- as its events are visible. Concurrent producers of one key queue here, as they would on
-- the aggregate's row lock.
CREATE OR REPLACE FUNCTION sequence_ordered_event() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1885958245, hashtext(NEW.ordering_key));
    NEW.seq := nextval(pg_get_serial_sequence('outbox', 'seq'));
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_sequence ON outbox;
CREATE TRIGGER outbox_sequence BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL) EXECUTE FUNCTION sequence_ordered_event();

DROP TRIGGER IF EXISTS outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION notify_outbox(:channel);
