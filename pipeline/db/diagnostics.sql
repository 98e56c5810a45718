-- Named queries of `pipeline status` (per-consumer activity) and `pipeline doctor`.
-- See queries.sql for the conventions.

-- name: consumer_activity
-- Per consumer, what happened in the last %(interval)s seconds, each figure from the index
-- on its time column: handler runs committed (inbox), failed handler attempts (attempt
-- history), duplicates acknowledged and deliveries sent again (delivery_log), and
-- consume-stage dead letters.
WITH since AS (
    SELECT clock_timestamp() - make_interval(secs => %(interval)s) AS at
)
SELECT i.consumer, 'processed', count(*)
FROM {schema}.inbox i, since
WHERE i.processed_at >= since.at AND i.status = 'processed'
GROUP BY i.consumer
UNION ALL
SELECT a.consumer, 'failures', count(*)
FROM {schema}.attempts a, since
WHERE a.occurred_at >= since.at AND a.stage = 'consume' AND a.consumer IS NOT NULL
GROUP BY a.consumer
UNION ALL
SELECT l.consumer, l.kind, count(*)
FROM {schema}.delivery_log l, since
WHERE l.at >= since.at
GROUP BY l.consumer, l.kind
UNION ALL
SELECT d.consumer, 'dead_letters', count(*)
FROM {schema}.dead_letters d, since
WHERE d.created_at >= since.at AND d.stage = 'consume' AND d.consumer IS NOT NULL
GROUP BY d.consumer;

-- name: doctor_migrations
SELECT version, checksum FROM {schema}.schema_migrations ORDER BY version;

-- name: doctor_indexes
-- Every index of the schema's tables, and whether it is usable (a failed CREATE INDEX
-- CONCURRENTLY leaves an invalid one behind).
SELECT i.relname, x.indisvalid
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_namespace n ON n.oid = i.relnamespace
WHERE n.nspname = %(schema_name)s;

-- name: doctor_triggers
SELECT t.tgname, c.relname, t.tgenabled <> 'D'
FROM pg_trigger t
JOIN pg_class c ON c.oid = t.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema_name)s AND NOT t.tgisinternal;

-- name: doctor_functions
SELECT p.proname FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = %(schema_name)s;

-- name: doctor_server
-- The database's clock (as Unix time), the notification queue's fill (0 to 1) and the
-- server process of this session (a pooler hands out its own process ids).
SELECT extract(epoch FROM clock_timestamp())::float8, pg_notification_queue_usage()::float8,
       pg_backend_pid();

-- name: doctor_dead_letters
SELECT stage, count(*) FROM {schema}.dead_letters WHERE replayed_at IS NULL GROUP BY stage;

-- name: doctor_canary
-- Seconds since the canary consumer last processed a heartbeat (NULL: never).
SELECT extract(epoch FROM clock_timestamp() - max(processed_at))::float8
FROM {schema}.inbox WHERE consumer = %(consumer)s AND status = 'processed';
