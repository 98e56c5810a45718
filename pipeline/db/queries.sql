-- Named queries of the relay and the admin tools, loaded once by pipeline/db/queries.py.
-- {schema} is replaced by the quoted schema identifier; values are %(name)s parameters.

-- name: claim
-- Claim due events in sequence order (functions.sql, claim_outbox): one statement, so an
-- idle relay's claim is one round trip and one (asynchronous) commit.
SELECT id, seq, aggregate_type, aggregate_id, ordering_key, event_type, event_version,
       payload, headers, attempts, created_at
FROM {schema}.claim_outbox(%(schema_name)s, %(scan_limit)s, %(max_run)s, %(batch_size)s,
                           %(token)s, %(owner)s, %(lease_seconds)s);

-- name: mark_sent
-- Commits asynchronously (set_config local to this transaction, as in claim_outbox): a lost
-- outcome only re-publishes, which the inbox absorbs. Records the consumers each event was
-- delivered to (ledger.sql): ``route_types[i]`` went to the comma-separated
-- ``route_consumers[i]`` (names are identifiers: no commas).
UPDATE {schema}.outbox o
SET status = 'sent', published_at = clock_timestamp(),
    lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL,
    consumers = string_to_array(r.consumers, ',')
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit,
     unnest(%(route_types)s::text[], %(route_consumers)s::text[]) AS r (event_type, consumers)
WHERE o.id = ANY(%(ids)s) AND o.lease_token = %(token)s AND o.status = 'publishing'
  AND o.event_type = r.event_type
RETURNING o.id, o.event_type, extract(epoch FROM o.published_at - o.created_at)::float8;

-- name: release
-- Give back claimed events that were not attempted (an earlier event of their key failed).
UPDATE {schema}.outbox
SET status = 'pending', attempts = attempts - 1,
    lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
WHERE id = ANY(%(ids)s) AND lease_token = %(token)s AND status = 'publishing';

-- name: schedule_retry
-- Failed attempts go back to pending after their jittered delay; the rest of their
-- ordering key waits at least as long, so it does not crowd the claim's scan window.
WITH failed AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(delays)s::float8[], %(error_classes)s::text[],
                         %(errors)s::text[]) AS f(id, delay, error_class, error)
), updated AS (
    UPDATE {schema}.outbox o
    SET status = 'pending',
        next_attempt_at = clock_timestamp() + make_interval(secs => f.delay),
        last_error = f.error, last_error_class = f.error_class,
        lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
    FROM failed f
    WHERE o.id = f.id AND o.lease_token = %(token)s AND o.status = 'publishing'
    RETURNING o.id, o.ordering_key, o.seq, o.attempts, o.next_attempt_at,
              f.error_class, f.error
), history AS (
    INSERT INTO {schema}.attempts (event_id, stage, attempt, error_class, error)
    SELECT id, 'publish', attempts, error_class, error FROM updated
)
UPDATE {schema}.outbox later
SET next_attempt_at = greatest(later.next_attempt_at, u.next_attempt_at)
FROM updated u
WHERE u.ordering_key IS NOT NULL AND later.ordering_key = u.ordering_key
  AND later.status = 'pending' AND later.seq > u.seq;

-- name: dead_letter
-- Exhausted or permanently failing events become dead letters, with their history kept.
WITH failed AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(reasons)s::text[], %(error_classes)s::text[],
                         %(errors)s::text[]) AS f(id, reason, error_class, error)
), updated AS (
    UPDATE {schema}.outbox o
    SET status = 'dead', last_error = f.error, last_error_class = f.error_class,
        lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
    FROM failed f
    WHERE o.id = f.id AND o.lease_token = %(token)s AND o.status = 'publishing'
    RETURNING o.id, o.event_type, o.attempts, f.reason, f.error_class, f.error
), history AS (
    INSERT INTO {schema}.attempts (event_id, stage, attempt, error_class, error)
    SELECT id, 'publish', attempts, error_class, error FROM updated
)
INSERT INTO {schema}.dead_letters (stage, event_id, event_type, reason, error_class, error,
                                   attempts)
SELECT 'publish', id, event_type, reason, error_class, error, attempts FROM updated
RETURNING event_id, event_type;

-- name: has_due_work
SELECT EXISTS (
    SELECT 1 FROM {schema}.outbox
    WHERE status IN ('pending', 'publishing')
      AND ((status = 'pending' AND next_attempt_at <= clock_timestamp())
           OR (status = 'publishing' AND lease_expires_at < clock_timestamp()))
);

-- name: relay_heartbeat
-- Returns the database's clock_timestamp(): the process measures its clock offset by it.
INSERT INTO {schema}.relay_state (relay_id, busy, heartbeat_at, host, pid, clock_offset)
VALUES (%(process_id)s, %(busy)s, clock_timestamp(), %(host)s, %(pid)s, %(clock_offset)s)
ON CONFLICT (relay_id) DO UPDATE
SET busy = excluded.busy, heartbeat_at = excluded.heartbeat_at,
    clock_offset = coalesce(excluded.clock_offset, relay_state.clock_offset)
RETURNING extract(epoch FROM clock_timestamp())::float8;

-- name: relay_forget
DELETE FROM {schema}.relay_state WHERE relay_id = %(process_id)s;

-- name: worker_heartbeat
-- Returns the database's clock_timestamp(): the process measures its clock offset by it.
INSERT INTO {schema}.worker_state (worker_id, busy, heartbeat_at, host, pid, clock_offset)
VALUES (%(process_id)s, %(busy)s, clock_timestamp(), %(host)s, %(pid)s, %(clock_offset)s)
ON CONFLICT (worker_id) DO UPDATE
SET busy = excluded.busy, heartbeat_at = excluded.heartbeat_at,
    clock_offset = coalesce(excluded.clock_offset, worker_state.clock_offset)
RETURNING extract(epoch FROM clock_timestamp())::float8;

-- name: worker_forget
DELETE FROM {schema}.worker_state WHERE worker_id = %(process_id)s;

-- name: worker_states
SELECT worker_id, host, pid, busy,
       extract(epoch FROM clock_timestamp() - heartbeat_at)::float8 AS heartbeat_age,
       clock_offset
FROM {schema}.worker_state
ORDER BY host, pid;

-- name: snapshot_xmax
SELECT pg_snapshot_xmax(pg_current_snapshot())::text;

-- name: horizon_passed
SELECT pg_snapshot_xmin(pg_current_snapshot()) >= %(xmax)s::xid8;

-- name: state_snapshot
-- The state behind the relay's gauges and `pipeline status`, in one cheap statement:
-- unsent events by status and the oldest one (both on the partial index of unsent rows;
-- seq order is insert order), and dead letters not yet replayed, by stage.
SELECT 'backlog' AS kind, status AS label, count(*)::float8 AS value
FROM {schema}.outbox
WHERE status IN ('pending', 'publishing')
GROUP BY status
UNION ALL
SELECT 'oldest_pending_age', '', coalesce(extract(epoch FROM clock_timestamp() - (
    SELECT created_at FROM {schema}.outbox
    WHERE status IN ('pending', 'publishing')
    ORDER BY seq
    LIMIT 1
)), 0)::float8
UNION ALL
SELECT 'dead_letters', stage, count(*)::float8
FROM {schema}.dead_letters
WHERE replayed_at IS NULL
GROUP BY stage;

-- name: relay_states
SELECT relay_id, host, pid, busy,
       extract(epoch FROM clock_timestamp() - heartbeat_at)::float8 AS heartbeat_age,
       clock_offset
FROM {schema}.relay_state
ORDER BY relay_id;

-- name: lineage_event
SELECT id, seq, event_type, event_version, aggregate_type, aggregate_id, ordering_key, status,
       attempts, created_at, published_at, last_error_class, last_error,
       headers ->> 'traceparent', headers ->> 'correlation_id', headers ->> 'causation_id',
       consumers, clock_timestamp()
FROM {schema}.outbox WHERE id = %(event_id)s;

-- name: lineage_children
SELECT id FROM {schema}.outbox WHERE headers ->> 'causation_id' = %(event_id)s::text ORDER BY seq;

-- name: lineage_attempts
SELECT stage, consumer, attempt, error_class, error, occurred_at
FROM {schema}.attempts WHERE event_id = %(event_id)s ORDER BY occurred_at, id;

-- name: lineage_inbox
SELECT consumer, status, attempts, received_at, processed_at, last_error_class, delivered_at,
       redeliveries
FROM {schema}.inbox WHERE event_id = %(event_id)s ORDER BY consumer;

-- name: lineage_dead_letters
SELECT id, stage, consumer, reason, error_class, created_at
FROM {schema}.dead_letters WHERE event_id = %(event_id)s ORDER BY id;

-- name: outbox_insert
-- The producer's insert: any number of events in one statement, in array order (the order
-- in which the sequence trigger takes their key locks). Payload and headers arrive as JSON
-- text the producer already serialised and size-checked.
INSERT INTO {schema}.outbox (id, aggregate_type, aggregate_id, ordering_key, event_type,
                             event_version, payload, headers)
SELECT id, aggregate_type, aggregate_id, ordering_key, event_type, event_version,
       payload::jsonb, headers::jsonb
FROM unnest(%(ids)s::uuid[], %(aggregate_types)s::text[], %(aggregate_ids)s::text[],
            %(ordering_keys)s::text[], %(event_types)s::text[], %(event_versions)s::int[],
            %(payloads)s::text[], %(headers)s::text[]) WITH ORDINALITY
     AS e(id, aggregate_type, aggregate_id, ordering_key, event_type, event_version, payload,
          headers, position)
ORDER BY position;

-- name: outbox_insert_one
-- outbox_insert for the common case of one event: scalar parameters (binding eight
-- one-element arrays costs the producer ~100 us of CPU more per transaction).
INSERT INTO {schema}.outbox (id, aggregate_type, aggregate_id, ordering_key, event_type,
                             event_version, payload, headers)
VALUES (%(id)s, %(aggregate_type)s, %(aggregate_id)s, %(ordering_key)s, %(event_type)s,
        %(event_version)s, %(payload)s::jsonb, %(headers)s::jsonb);

-- name: canary_insert
-- The end-to-end canary: a heartbeat event through the whole path (unordered, tiny).
INSERT INTO {schema}.outbox (id, event_type, payload, headers)
VALUES (%(id)s, %(event_type)s, %(payload)s::jsonb, %(headers)s::jsonb);

-- name: missing_privileges
-- Which of the wanted (table, privilege) pairs the current role lacks, and whether it lacks
-- USAGE on the schema; tables not installed are skipped. The catalogs are read by oid, so
-- the check itself needs no privilege on the schema. The schema is a value here.
SELECT current_user, w.table_name, w.privilege
FROM unnest(%(tables)s::text[], %(privileges)s::text[]) AS w (table_name, privilege)
JOIN pg_namespace n ON n.nspname = %(schema_name)s
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.table_name
WHERE NOT has_table_privilege(c.oid, w.privilege)
UNION ALL
SELECT current_user, NULL, 'USAGE'
FROM pg_namespace n
WHERE n.nspname = %(schema_name)s AND NOT has_schema_privilege(n.oid, 'USAGE');
