-- Named queries of `pipeline demo` (pipeline/tools/demo/sql.py; the shared ones are in tools/harness).
-- {app} is the demo's business schema, {schema} the pipeline's schema (quoted identifiers);
-- values are %(name)s parameters. Every row of a demo run carries the run id, so the
-- summary of one run never counts another's rows.

-- name: create_tables
-- Business tables. The effect tables have no unique key on order_id on purpose: a handler
-- that ran twice would leave a second row (which the summary counts), not an error.
CREATE SCHEMA IF NOT EXISTS {app};
CREATE TABLE IF NOT EXISTS {app}.demo_orders (
    order_id text PRIMARY KEY,
    run text NOT NULL,
    customer text NOT NULL,
    sku text NOT NULL,
    quantity integer NOT NULL,
    amount_cents integer,
    status text NOT NULL DEFAULT 'placed',
    placed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS {app}.demo_payments (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run text NOT NULL,
    order_id text NOT NULL,
    charge_id text NOT NULL,
    amount_cents integer NOT NULL,
    charged_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS {app}.demo_stock (
    sku text PRIMARY KEY,
    available integer NOT NULL CHECK (available >= 0)
);
CREATE TABLE IF NOT EXISTS {app}.demo_reservations (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run text NOT NULL,
    order_id text NOT NULL,
    sku text NOT NULL,
    quantity integer NOT NULL,
    reserved_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS {app}.demo_confirmations (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run text NOT NULL,
    order_id text NOT NULL,
    message_id text NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- name: seed_stock
INSERT INTO {app}.demo_stock (sku, available)
SELECT 'sku-' || lpad(n::text, 3, '0'), %(available)s
FROM generate_series(1, %(skus)s) AS n
ON CONFLICT (sku) DO NOTHING;

-- name: drop_schema
-- Only ever run on a schema this run created with create_schema (or migrated into a
-- schema it created), never on a configured one.
DROP SCHEMA IF EXISTS {app} CASCADE;

-- name: place_order
INSERT INTO {app}.demo_orders (order_id, run, customer, sku, quantity, amount_cents)
VALUES (%(order_id)s, %(run)s, %(customer)s, %(sku)s, %(quantity)s, %(amount_cents)s);

-- name: record_payment
INSERT INTO {app}.demo_payments (run, order_id, charge_id, amount_cents)
VALUES (%(run)s, %(order_id)s, %(charge_id)s, %(amount_cents)s);

-- name: reserve_stock
UPDATE {app}.demo_stock SET available = available - %(quantity)s
WHERE sku = %(sku)s AND available >= %(quantity)s
RETURNING available;

-- name: record_reservation
INSERT INTO {app}.demo_reservations (run, order_id, sku, quantity)
VALUES (%(run)s, %(order_id)s, %(sku)s, %(quantity)s);

-- name: record_confirmation
INSERT INTO {app}.demo_confirmations (run, order_id, message_id)
VALUES (%(run)s, %(order_id)s, %(message_id)s);

-- name: confirm_order
UPDATE {app}.demo_orders SET status = 'confirmed' WHERE order_id = %(order_id)s;

-- name: consumer_progress
-- Per consumer: events of this run processed and dead-lettered.
SELECT i.consumer,
       count(*) FILTER (WHERE i.status = 'processed') AS processed,
       count(*) FILTER (WHERE i.status = 'dead') AS dead
FROM {schema}.inbox i
JOIN {schema}.outbox o ON o.id = i.event_id
WHERE o.payload ->> 'run' = %(run)s
GROUP BY i.consumer;

-- name: outbox_counts
SELECT event_type, status, count(*) FROM {schema}.outbox
WHERE payload ->> 'run' = %(run)s
GROUP BY event_type, status;

-- name: unfinished_inbox
SELECT count(*) FROM {schema}.inbox i
JOIN {schema}.outbox o ON o.id = i.event_id
WHERE o.payload ->> 'run' = %(run)s AND i.status IN ('pending', 'failed');

-- name: failed_attempts
SELECT a.consumer, a.error_class, count(*)
FROM {schema}.attempts a
JOIN {schema}.outbox o ON o.id = a.event_id
WHERE a.stage = 'consume' AND o.payload ->> 'run' = %(run)s
GROUP BY a.consumer, a.error_class
ORDER BY a.consumer, a.error_class;

-- name: dead_letters
SELECT d.stage, d.consumer, d.event_type, d.event_id::text, o.payload ->> 'order_id',
       d.reason, d.error_class, d.error, d.attempts
FROM {schema}.dead_letters d
JOIN {schema}.outbox o ON o.id = d.event_id
WHERE o.payload ->> 'run' = %(run)s
ORDER BY d.id;

-- name: effects
-- Rows per business table and the distinct orders they cover (equal when nothing ran twice).
SELECT 'payments' AS stage, count(*), count(DISTINCT order_id)
FROM {app}.demo_payments WHERE run = %(run)s
UNION ALL
SELECT 'inventory', count(*), count(DISTINCT order_id)
FROM {app}.demo_reservations WHERE run = %(run)s
UNION ALL
SELECT 'notifications', count(*), count(DISTINCT order_id)
FROM {app}.demo_confirmations WHERE run = %(run)s;

-- name: orders_by_status
SELECT status, count(*) FROM {app}.demo_orders WHERE run = %(run)s GROUP BY status;

-- name: order_latencies
-- Each order's created (order.placed written) -> confirmed (the notifications consumer's
-- inbox claim of the order's stock.reserved event), following the causation chain.
SELECT p.id::text, p.payload ->> 'order_id',
       extract(epoch FROM i.processed_at - p.created_at)::float8 AS seconds,
       (SELECT count(*) FROM {schema}.attempts a
        WHERE a.event_id IN (p.id, c.id, r.id)) AS failed_attempts
FROM {schema}.outbox p
JOIN {schema}.outbox c
  ON c.headers ->> 'causation_id' = p.id::text AND c.event_type = 'payment.charged'
JOIN {schema}.outbox r
  ON r.headers ->> 'causation_id' = c.id::text AND r.event_type = 'stock.reserved'
JOIN {schema}.inbox i
  ON i.event_id = r.id AND i.consumer = 'notifications' AND i.status = 'processed'
WHERE p.event_type = 'order.placed' AND p.payload ->> 'run' = %(run)s;

-- name: lineage
-- An event and everything it caused (follow-up events, transitively).
WITH RECURSIVE chain AS (
    SELECT o.id, 0 AS depth FROM {schema}.outbox o WHERE o.id = %(root)s
    UNION ALL
    SELECT o.id, chain.depth + 1
    FROM {schema}.outbox o
    JOIN chain ON o.headers ->> 'causation_id' = chain.id::text
    WHERE chain.depth < 20
)
SELECT o.id::text, o.event_type, o.headers ->> 'causation_id', o.headers ->> 'traceparent',
       o.created_at, o.published_at, o.status, o.attempts
FROM chain JOIN {schema}.outbox o ON o.id = chain.id
ORDER BY o.created_at;

-- name: lineage_inbox
SELECT event_id::text, consumer, status, attempts, received_at, processed_at
FROM {schema}.inbox WHERE event_id = ANY(%(ids)s::uuid[])
ORDER BY received_at;

-- name: lineage_attempts
SELECT event_id::text, consumer, attempt, error_class, occurred_at
FROM {schema}.attempts WHERE event_id = ANY(%(ids)s::uuid[]) AND stage = 'consume'
ORDER BY occurred_at;

-- name: sent_since
-- Events of this run already sent, for the duplicate injector to deliver once more.
SELECT id, seq, aggregate_type, aggregate_id, ordering_key, event_type, event_version,
       payload::text, headers::text, attempts, created_at, published_at
FROM {schema}.outbox
WHERE status = 'sent' AND payload ->> 'run' = %(run)s AND published_at >= %(since)s
ORDER BY seq;
