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
-- enable_seqscan is off inside: PL/pgSQL caches the lookup's plan per connection, and a
-- plan made while the outbox looked empty (after a TRUNCATE, a fresh install, a VACUUM)
-- would otherwise scan every unsent row on each insert for the life of the connection.
CREATE OR REPLACE FUNCTION sequence_ordered_event() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(NEW.ordering_key, 1885958245));
    NEW.seq := nextval(pg_get_serial_sequence('outbox', 'seq'));
    -- Behind a head that waits for a retry, a new event waits at least as long: it could not
    -- be published earlier anyway, and not being due keeps it out of the claim's scan window,
    -- so a blocked key never crowds out the other keys.
    NEW.next_attempt_at := greatest(NEW.next_attempt_at, (
        SELECT o.next_attempt_at FROM outbox o
        WHERE o.ordering_key = NEW.ordering_key AND o.status = 'pending'
        ORDER BY o.seq DESC LIMIT 1
    ));
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_sequence ON outbox;
CREATE TRIGGER outbox_sequence BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL) EXECUTE FUNCTION sequence_ordered_event();

DROP TRIGGER IF EXISTS outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION notify_outbox(:channel);
