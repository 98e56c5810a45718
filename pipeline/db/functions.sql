-- Repeatable objects (functions and triggers), re-applied whenever this file changes.
-- Runs with search_path set to the pipeline schema. Placeholders filled in by migrate.py:
-- :channel the NOTIFY channel, :schema the quoted schema name, the ordering locks' class
-- and bucket count (pipeline/db/ordering.py), and :payload_limit the largest payload in
-- bytes (PIPELINE_MAX_PAYLOAD_BYTES's ceiling, pipeline/config.py). Every function pins its search_path to the
-- schema and then pg_temp, so that no temporary table of the caller can stand in for a
-- pipeline table.

-- Wake the relay after an outbox insert, but only while no relay is busy: a busy relay
-- polls continuously, and skipping NOTIFY spares producers its database-wide commit lock.
-- The payload is constant so that all notifications of one transaction fold into one.
-- SECURITY DEFINER (runs as the schema's owner), as sequence_ordered_event below: a
-- producer needs INSERT on the outbox and nothing else, not SELECT on relay_state.
CREATE OR REPLACE FUNCTION notify_outbox() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = :schema, pg_temp
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

-- Number ordered events under a transaction lock of their key, so that within one ordering
-- key sequence order is commit order: a committed event never has a higher seq than an event
-- of its key that is still to commit, and the relay can publish a key in seq order as soon
-- as its events are visible. Concurrent producers of one key queue here, as they would on
-- the aggregate's row lock. Keys share :ordering_lock_buckets locks (a bucket from the
-- SHA-256 of the key's UTF-8 bytes; pipeline/db/ordering.py computes the same), so a
-- transaction holds at most that many advisory locks however many keys it writes.
-- enable_seqscan is off inside: PL/pgSQL caches the lookup's plan per connection, and a
-- plan made while the outbox looked empty (after a TRUNCATE, a fresh install, a VACUUM)
-- would otherwise scan every unsent row on each insert for the life of the connection.
-- SECURITY DEFINER: the lookup reads other events' rows and nextval needs the sequence,
-- neither of which a producer may do itself (it can write events, not read them). The
-- function's only inputs are the new row's ordering key and due time, used as values, and
-- its search_path is pinned, so running it with the owner's rights gives the caller
-- nothing else.
CREATE OR REPLACE FUNCTION sequence_ordered_event() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = :schema, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    digest bytea := sha256(convert_to(NEW.ordering_key, 'UTF8'));
BEGIN
    PERFORM pg_advisory_xact_lock(
        :ordering_lock_class,
        mod(get_byte(digest, 0) * 256 + get_byte(digest, 1), :ordering_lock_buckets)
    );
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

-- Refuse an outbox payload larger than add_event accepts, whatever role writes the row, by
-- add_event's own measure: bytes of compact JSON (no space after ',' or ':'), numbers as
-- Postgres prints them. The trigger's WHEN reads the jsonb text (one space after each
-- separator), never shorter than the compact form, so an ordinary event pays that
-- conversion once, at insert, and no update that leaves the payload alone pays anything
-- (a CHECK would run on every status change). Only a text over the limit comes here to be
-- measured exactly: json_strip_nulls writes compact JSON, and the replace keeps it from
-- dropping object members whose value is null (": null" occurs in the text only there or
-- inside a string, and "1234" has the same length). ERRCODE and CONSTRAINT make it read
-- as a CHECK violation of outbox_payload_size_check.
CREATE OR REPLACE FUNCTION refuse_oversize_payload() RETURNS trigger
LANGUAGE plpgsql
SET search_path = :schema, pg_temp
AS $$
DECLARE
    size integer := octet_length(
        json_strip_nulls(replace(NEW.payload::text, ': null', ': 1234')::json)::text
    );
BEGIN
    IF size > :payload_limit THEN
        RAISE EXCEPTION USING
            MESSAGE = 'outbox payload is ' || size
                || ' bytes of compact JSON, over the limit of :payload_limit',
            ERRCODE = 'check_violation', CONSTRAINT = 'outbox_payload_size_check',
            TABLE = TG_TABLE_NAME, SCHEMA = TG_TABLE_SCHEMA;
    END IF;
    RETURN NEW;
END
$$;

-- Claim due events in sequence order. Within an ordering key, seq order is commit order
-- (the outbox_sequence trigger numbers a key's events under a transaction lock), so a key
-- is claimed as a run with no unsent event before it or between its parts. Expired leases
-- are reclaimed (their publisher died). Claims are serialised per schema by an advisory
-- lock (they take milliseconds), so that a claim never runs on a snapshot older than
-- another publisher's committed claim of the same key: in a function, the UPDATE below
-- takes its snapshot after the lock, and the whole claim is one statement for the caller.
-- A claim never waits on a row lock while it holds that lock: the rows it chose are
-- locked with SKIP LOCKED first. A row another transaction holds (a publisher stopped
-- between its sent mark and its COMMIT, whose lease expired meanwhile) is left out, and
-- so is the rest of its key's run in this claim (a prefix of a run is always safe to
-- publish, a run with a hole is not); a later claim takes them once that transaction
-- ended. Every other key goes on being claimed, so one stopped publisher holds back only
-- the keys it holds, never the others.
-- enable_seqscan is off inside, as for sequence_ordered_event: PL/pgSQL caches the plan,
-- and one made while the outbox looked empty would scan the whole table on every claim.
-- enable_bitmapscan is off too: a bitmap scan never marks an index entry dead, so every
-- claim between two vacuums visited the entry of every event sent since the last one
-- (thousands at 1,000 events/s); a plain index scan in seq order marks them on its way.
-- It runs with the caller's rights (SECURITY INVOKER): only a role granted UPDATE on the
-- outbox (relays, workers running publishing actors) can claim.
CREATE OR REPLACE FUNCTION claim_outbox(
    p_schema_name text, p_scan_limit integer, p_max_run integer, p_batch_size integer,
    p_token bigint, p_owner text, p_lease_seconds double precision
)
RETURNS TABLE (
    id uuid, seq bigint, aggregate_type text, aggregate_id text, ordering_key text,
    event_type text, event_version integer, payload text, headers text, attempts integer,
    created_at timestamptz
)
LANGUAGE plpgsql
SET search_path = :schema, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
BEGIN
    -- A claim needs no WAL flush before the relay goes on: one lost in a server crash
    -- leaves its events claimable, they are published again and the inbox absorbs the copy.
    -- Local to this transaction: a session-level SET would leak to other clients through a
    -- transaction-pooling PgBouncer.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtext('pipeline.claim.' || p_schema_name));
    RETURN QUERY
    WITH scanned AS (
        SELECT o.id, o.ordering_key, o.seq, o.status, o.lease_token
        FROM outbox o
        WHERE o.status IN ('pending', 'publishing')
          AND ((o.status = 'pending' AND o.next_attempt_at <= statement_timestamp())
               OR (o.status = 'publishing' AND o.lease_expires_at < statement_timestamp()))
        ORDER BY o.seq
        LIMIT p_scan_limit
    ), placed AS (
        SELECT s.*,
               lag(s.seq) OVER w AS prev_seq,
               row_number() OVER w AS run_position
        FROM scanned s
        WINDOW w AS (PARTITION BY s.ordering_key ORDER BY s.seq)
    ), checked AS (
        SELECT p.*,
               p.ordering_key IS NULL OR NOT EXISTS (
                   SELECT 1 FROM outbox b
                   WHERE b.ordering_key = p.ordering_key
                     AND b.status IN ('pending', 'publishing')
                     AND b.seq < p.seq
                     AND (p.prev_seq IS NULL OR b.seq > p.prev_seq)
               ) AS gap_free
        FROM placed p
    ), runs AS (
        SELECT c.*,
               bool_and(c.gap_free) OVER (PARTITION BY c.ordering_key ORDER BY c.seq) AS run_ok
        FROM checked c
    ), chosen AS (
        SELECT r.id, r.ordering_key, r.seq FROM runs r
        WHERE (r.ordering_key IS NULL OR (r.run_ok AND r.run_position <= p_max_run))
        ORDER BY r.seq
        LIMIT p_batch_size
    ), locked AS (
        -- The chosen rows still claimable, locked now; rows another transaction holds
        -- are skipped, never waited for.
        SELECT l.id FROM outbox l
        WHERE l.id = ANY (ARRAY(SELECT id FROM chosen))
          AND ((l.status = 'pending' AND l.lease_token IS NULL)
               OR (l.status = 'publishing' AND l.lease_expires_at < statement_timestamp()))
        FOR UPDATE SKIP LOCKED
    ), cut AS (
        -- Per key, the first chosen row not locked: the key's run stops before it.
        SELECT c.ordering_key, min(c.seq) AS seq FROM chosen c
        WHERE c.ordering_key IS NOT NULL AND c.id NOT IN (SELECT id FROM locked)
        GROUP BY c.ordering_key
    ), claimable AS (
        SELECT c.id FROM chosen c
        JOIN locked l ON l.id = c.id
        LEFT JOIN cut ON cut.ordering_key = c.ordering_key
        WHERE cut.seq IS NULL OR c.seq < cut.seq
    )
    UPDATE outbox o
    SET status = 'publishing',
        attempts = o.attempts + 1,
        lease_token = p_token,
        lease_owner = p_owner,
        lease_expires_at = clock_timestamp() + make_interval(secs => p_lease_seconds)
    -- The ids as an array: primary-key lookups whatever the planner thinks of the CTE's size
    -- (a hash join over the whole outbox cost more than the rest of the claim).
    WHERE o.id = ANY (ARRAY(SELECT id FROM claimable))
    -- Still claimable: a stale publisher may have marked an expired lease sent (or dead) since
    -- the snapshot, and that outcome stands. One it gave back (released, or rescheduled for a
    -- retry) is pending again and is taken now, so a key's run is claimed whole.
      AND ((o.status = 'pending' AND o.lease_token IS NULL)
           OR (o.status = 'publishing' AND o.lease_expires_at < statement_timestamp()))
    RETURNING o.id, o.seq, o.aggregate_type, o.aggregate_id, o.ordering_key,
              o.event_type, o.event_version, o.payload::text, o.headers::text, o.attempts,
              o.created_at;
END
$$;

DROP TRIGGER IF EXISTS outbox_payload_size ON outbox;
CREATE TRIGGER outbox_payload_size BEFORE INSERT OR UPDATE OF payload ON outbox
    FOR EACH ROW WHEN (octet_length(NEW.payload::text) > :payload_limit)
    EXECUTE FUNCTION refuse_oversize_payload();

DROP TRIGGER IF EXISTS outbox_sequence ON outbox;
CREATE TRIGGER outbox_sequence BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL) EXECUTE FUNCTION sequence_ordered_event();

DROP TRIGGER IF EXISTS outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION notify_outbox(:channel);
