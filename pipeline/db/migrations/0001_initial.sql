-- Initial schema: outbox, inbox, attempt history, dead letters, operator audit, relay state.
-- Runs with search_path set to the pipeline schema; names are unqualified on purpose.

CREATE TABLE outbox (
    id uuid PRIMARY KEY,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    aggregate_type text,
    aggregate_id text,
    ordering_key text,
    event_type text NOT NULL,
    event_version integer NOT NULL DEFAULT 1,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    status text NOT NULL DEFAULT 'pending'::text,
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    lease_token bigint,
    lease_owner text,
    lease_expires_at timestamptz,
    last_error text,
    last_error_class text,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at timestamptz,
    CONSTRAINT outbox_status_check
        CHECK (status IN ('pending', 'publishing', 'sent', 'dead'))
);
-- The claim scans unsent rows in sequence order; the key index finds predecessors.
CREATE INDEX outbox_unsent_idx ON outbox (seq)
    WHERE status IN ('pending', 'publishing');
CREATE INDEX outbox_key_idx ON outbox (ordering_key, seq)
    WHERE status IN ('pending', 'publishing') AND ordering_key IS NOT NULL;
CREATE INDEX outbox_published_idx ON outbox (published_at) WHERE status = 'sent';
CREATE INDEX outbox_causation_idx ON outbox ((headers ->> 'causation_id'));

CREATE TABLE inbox (
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    event_type text NOT NULL,
    ordering_key text,
    seq bigint,
    status text NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    received_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    processed_at timestamptz,
    last_error text,
    last_error_class text,
    CONSTRAINT inbox_pkey PRIMARY KEY (consumer, event_id),
    CONSTRAINT inbox_status_check CHECK (status IN ('pending', 'processed', 'failed', 'dead'))
);
CREATE INDEX inbox_processed_idx ON inbox (processed_at);
-- Ordered consumers look for an earlier event of the key that is delivered but not done.
CREATE INDEX inbox_unfinished_idx ON inbox (consumer, ordering_key, seq)
    WHERE status IN ('pending', 'failed');
CREATE INDEX inbox_event_idx ON inbox (event_id);

CREATE TABLE attempts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    stage text NOT NULL,
    consumer text,
    attempt integer NOT NULL,
    error_class text NOT NULL,
    error text NOT NULL,
    occurred_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT attempts_stage_check CHECK (stage IN ('publish', 'consume'))
);
CREATE INDEX attempts_event_idx ON attempts (event_id);

CREATE TABLE dead_letters (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stage text NOT NULL,
    event_id uuid,
    consumer text,
    event_type text,
    queue text,
    reason text NOT NULL,
    error_class text NOT NULL,
    error text NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    envelope jsonb,
    raw_message text,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    replayed_at timestamptz,
    replay_count integer NOT NULL DEFAULT 0,
    CONSTRAINT dead_letters_stage_check CHECK (stage IN ('publish', 'consume'))
);
CREATE INDEX dead_letters_created_idx ON dead_letters (stage, created_at);
CREATE INDEX dead_letters_event_idx ON dead_letters (event_id);

CREATE TABLE audit_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor text NOT NULL,
    action text NOT NULL,
    parameters jsonb NOT NULL DEFAULT '{}'::jsonb,
    affected integer NOT NULL DEFAULT 0
);

CREATE TABLE relay_state (
    relay_id text PRIMARY KEY,
    busy boolean NOT NULL DEFAULT false,
    heartbeat_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    host text NOT NULL,
    pid integer NOT NULL
);
