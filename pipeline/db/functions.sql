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

DROP TRIGGER IF EXISTS outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION notify_outbox(:channel);
