-- Named queries of `pipeline drill` (pipeline/tools/drill/sql.py; the shared ones are in tools/harness).
-- {schema} is the drill's pipeline schema and {app} its business schema (quoted identifiers,
-- both made by the drill for this run alone); values are %(name)s parameters.

-- name: create_tables
-- The effect table has no unique key on (consumer, event_id) on purpose: a handler whose
-- work committed twice leaves a second row, which the checker counts.
CREATE TABLE {app}.orders (
    order_id text PRIMARY KEY,
    event_id uuid NOT NULL UNIQUE,
    account text NOT NULL,
    n integer NOT NULL,
    amount_cents integer,
    poison boolean NOT NULL,
    producer text NOT NULL,
    placed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE {app}.effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    order_id text NOT NULL,
    key text,
    seq bigint NOT NULL,
    n integer NOT NULL,
    position integer,
    ref text,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX effects_event_idx ON {app}.effects (consumer, event_id);
CREATE TABLE {app}.key_positions (
    consumer text NOT NULL,
    key text NOT NULL,
    handled integer NOT NULL,
    PRIMARY KEY (consumer, key)
);

-- name: drop_schemas
-- Only ever run on the schemas this run created.
DROP SCHEMA IF EXISTS {app} CASCADE;
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- name: place_order
INSERT INTO {app}.orders (order_id, event_id, account, n, amount_cents, poison, producer)
VALUES (%(order_id)s, %(event_id)s, %(account)s, %(n)s, %(amount_cents)s, %(poison)s,
        %(producer)s);

-- name: order_event
-- After a commit whose outcome is unknown (the connection broke): did it land?
SELECT event_id FROM {app}.orders WHERE order_id = %(order_id)s;

-- name: take_position
-- An ordered consumer's next position for a key. The row lock is held until the handler's
-- transaction ends, so positions follow the order in which that work committed.
INSERT INTO {app}.key_positions AS k (consumer, key, handled)
VALUES (%(consumer)s, %(key)s, 1)
ON CONFLICT (consumer, key) DO UPDATE SET handled = k.handled + 1
RETURNING handled;

-- name: record_effect
INSERT INTO {app}.effects (consumer, event_id, order_id, key, seq, n, position, ref)
VALUES (%(consumer)s, %(event_id)s, %(order_id)s, %(key)s, %(seq)s, %(n)s, %(position)s,
        %(ref)s);

-- name: database_clock
SELECT extract(epoch FROM clock_timestamp())::float8;

-- name: orders_placed
SELECT count(*), count(*) FILTER (WHERE poison) FROM {app}.orders;

-- name: delivery_counts
-- Per consumer: the (event, consumer) pairs owed by the events that exist, and their outcomes.
WITH routes AS (
    SELECT * FROM unnest(%(consumers)s::text[], %(event_types)s::text[]) AS r(consumer, event_type)
)
SELECT r.consumer,
       count(o.id) AS expected,
       count(i.event_id) FILTER (WHERE i.status = 'processed') AS processed,
       count(i.event_id) FILTER (WHERE i.status = 'dead') AS dead
FROM routes r
LEFT JOIN {schema}.outbox o ON o.event_type = r.event_type
LEFT JOIN {schema}.inbox i ON i.consumer = r.consumer AND i.event_id = o.id
GROUP BY r.consumer;

-- name: unsent_events
SELECT count(*) FROM {schema}.outbox
WHERE status IN ('pending', 'publishing') AND event_type = ANY(%(event_types)s);

-- name: sent_events
-- Events the relays marked sent (every type: follow-ups too).
SELECT count(*) FROM {schema}.outbox WHERE status = 'sent';

-- name: delivery_anomalies
-- Every (event, subscribed consumer) pair that is not cleanly done: done is one processed
-- inbox row with exactly one effect row, or, for a poison order, a dead inbox row and none.
WITH routes AS (
    SELECT * FROM unnest(%(consumers)s::text[], %(event_types)s::text[]) AS r(consumer, event_type)
), effects AS (
    SELECT consumer, event_id, count(*) AS n FROM {app}.effects GROUP BY consumer, event_id
)
SELECT r.consumer, o.id::text, o.event_type, o.payload ->> 'order_id', coalesce(ord.poison, false),
       o.status, extract(epoch FROM o.published_at)::float8, i.status, coalesce(e.n, 0),
       o.ordering_key, o.seq
FROM {schema}.outbox o
JOIN routes r ON r.event_type = o.event_type
LEFT JOIN {app}.orders ord ON ord.event_id = o.id
LEFT JOIN {schema}.inbox i ON i.consumer = r.consumer AND i.event_id = o.id
LEFT JOIN effects e ON e.consumer = r.consumer AND e.event_id = o.id
WHERE NOT coalesce(
    (NOT coalesce(ord.poison, false) AND i.status = 'processed' AND coalesce(e.n, 0) = 1)
    OR (coalesce(ord.poison, false) AND i.status = 'dead' AND coalesce(e.n, 0) = 0),
    false)
ORDER BY o.seq, r.consumer;

-- name: unknown_effects
-- Effect rows of an event that is not in the outbox, or of a consumer it was not routed to.
WITH routes AS (
    SELECT * FROM unnest(%(consumers)s::text[], %(event_types)s::text[]) AS r(consumer, event_type)
)
SELECT count(*) FROM {app}.effects f
WHERE NOT EXISTS (
    SELECT 1 FROM {schema}.outbox o JOIN routes r ON r.event_type = o.event_type
    WHERE o.id = f.event_id AND r.consumer = f.consumer
);

-- name: key_positions
-- What each ordered consumer handled, per key, in the order its work committed.
SELECT consumer, key, position, seq, n, event_id::text
FROM {app}.effects
WHERE position IS NOT NULL AND consumer = ANY(%(consumers)s)
ORDER BY consumer, key, position, id;

-- name: dead_letters
SELECT d.stage, d.consumer, d.event_id::text, d.event_type, d.reason, d.error_class,
       coalesce(ord.poison, false)
FROM {schema}.dead_letters d
LEFT JOIN {app}.orders ord ON ord.event_id = d.event_id
ORDER BY d.id;

-- name: atomicity
-- The producer's business row and its event commit together, or neither.
SELECT
    (SELECT count(*) FROM {app}.orders ord
     WHERE NOT EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.id = ord.event_id)),
    (SELECT count(*) FROM {schema}.outbox o
     WHERE o.event_type = %(root_type)s
       AND NOT EXISTS (SELECT 1 FROM {app}.orders ord WHERE ord.event_id = o.id));

-- name: outbox_counts
SELECT event_type, status, count(*) FROM {schema}.outbox
WHERE event_type = ANY(%(event_types)s)
GROUP BY event_type, status
ORDER BY event_type, status;

-- name: follow_up_counts
-- Follow-up events per order: a handler's follow-up commits with its work, so one each.
SELECT event_type, count(*) - count(DISTINCT payload ->> 'order_id')
FROM {schema}.outbox
WHERE event_type = ANY(%(event_types)s)
GROUP BY event_type;

-- name: ids_out_of_order
-- Keys whose UUIDv7 ids do not follow their sequence (producers with skewed clocks).
SELECT count(DISTINCT ordering_key), count(*)
FROM (
    SELECT ordering_key, id < lag(id) OVER (PARTITION BY ordering_key ORDER BY seq) AS back
    FROM {schema}.outbox
    WHERE event_type = %(root_type)s AND ordering_key IS NOT NULL
) s
WHERE back;

-- name: failed_attempts
-- Failed attempts by stage, consumer and error class, with one of their messages.
SELECT stage, coalesce(consumer, ''), error_class, count(*),
       left(split_part(min(error), E'\n', 1), 160)
FROM {schema}.attempts
GROUP BY stage, consumer, error_class
ORDER BY stage, consumer, error_class;

-- name: has_column
SELECT EXISTS (
    SELECT 1 FROM information_schema.columns
    WHERE table_schema = %(schema_name)s AND table_name = %(table)s AND column_name = %(column)s
);

-- name: redeliveries
SELECT coalesce(sum(redeliveries), 0) FROM {schema}.inbox WHERE consumer = ANY(%(consumers)s);

-- name: listen_backends
-- The relays' LISTEN connections: their last statement is the LISTEN or its health check.
SELECT pid, application_name FROM pg_stat_activity
WHERE application_name = ANY(%(names)s) AND backend_type = 'client backend'
  AND (left(query, 7) = 'LISTEN ' OR query = 'SELECT 1');

-- name: app_backends
SELECT pid, application_name, state FROM pg_stat_activity
WHERE application_name = ANY(%(names)s) AND backend_type = 'client backend'
  AND pid <> pg_backend_pid();

-- name: terminate
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM unnest(%(pids)s::int[]) AS pid;

-- name: order_ids
SELECT order_id, poison, event_id::text FROM {app}.orders;
