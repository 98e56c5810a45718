-- Named queries of retention (the relay's janitor and `pipeline prune`) and backpressure.
-- See queries.sql for the conventions.
--
-- Each prune query handles one batch: it scans up to %(limit)s of the table's oldest rows
-- past the cutoff (by the time column's index), newer than %(after)s (the previous batch's
-- last row, so one pass looks at each row once), deletes those that may go, and returns
-- (rows that may go, rows deleted, rows scanned, the last scanned row's time). With
-- %(dry_run)s the delete matches nothing: a dry run counts with exactly the same rules.
-- Rows are deleted by ctid and re-checked: a row changed since the scan (a new version)
-- is left for the next pass.

-- name: prune_lock
-- One prune at a time across relays and operators; held by the session for one pass.
SELECT pg_try_advisory_lock(hashtext('pipeline.prune.' || %(schema_name)s));

-- name: prune_unlock
SELECT pg_advisory_unlock(hashtext('pipeline.prune.' || %(schema_name)s));

-- name: prune_outbox
-- Sent events whose every consumer has an outcome (a processed or dead inbox row: nothing
-- is owed) and that no dead letter refers to (a replay needs the event for the ledger).
-- Pending, publishing and dead events are never scanned.
WITH scanned AS (
    SELECT o.ctid AS row_id, o.id, o.published_at, o.consumers
    FROM {schema}.outbox o
    WHERE o.status = 'sent' AND o.published_at < %(cutoff)s AND o.published_at > %(after)s
    ORDER BY o.published_at
    LIMIT %(limit)s
), doomed AS (
    SELECT s.row_id FROM scanned s
    WHERE NOT EXISTS (
        SELECT 1 FROM unnest(s.consumers) AS c (consumer)
        WHERE NOT EXISTS (
            SELECT 1 FROM {schema}.inbox i
            WHERE i.consumer = c.consumer AND i.event_id = s.id
              AND i.status IN ('processed', 'dead')
        )
    )
      AND NOT EXISTS (SELECT 1 FROM {schema}.dead_letters d WHERE d.event_id = s.id)
), deleted AS (
    DELETE FROM {schema}.outbox o
    WHERE NOT %(dry_run)s AND o.ctid = ANY (ARRAY(SELECT row_id FROM doomed))
      AND o.status = 'sent'
    RETURNING 1
)
SELECT (SELECT count(*) FROM doomed), (SELECT count(*) FROM deleted), count(*),
       max(published_at)
FROM scanned;

-- name: prune_inbox
-- Processed inbox keys whose event has left the outbox: while the event row is there, a
-- missing inbox row would mean "owed" to the delivery ledger. Pending, failed and dead
-- rows are never deleted.
WITH scanned AS (
    SELECT i.ctid AS row_id, i.event_id, i.processed_at
    FROM {schema}.inbox i
    WHERE i.processed_at < %(cutoff)s AND i.processed_at > %(after)s
      AND i.status = 'processed'
    ORDER BY i.processed_at
    LIMIT %(limit)s
), doomed AS (
    SELECT s.row_id FROM scanned s
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.id = s.event_id)
), deleted AS (
    DELETE FROM {schema}.inbox i
    WHERE NOT %(dry_run)s AND i.ctid = ANY (ARRAY(SELECT row_id FROM doomed))
      AND i.status = 'processed'
    RETURNING 1
)
SELECT (SELECT count(*) FROM doomed), (SELECT count(*) FROM deleted), count(*),
       max(processed_at)
FROM scanned;

-- name: prune_attempts
-- Attempt history, except that of events with a dead letter (an operator reads it there).
WITH scanned AS (
    SELECT a.ctid AS row_id, a.event_id, a.occurred_at
    FROM {schema}.attempts a
    WHERE a.occurred_at < %(cutoff)s AND a.occurred_at > %(after)s
    ORDER BY a.occurred_at
    LIMIT %(limit)s
), doomed AS (
    SELECT s.row_id FROM scanned s
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.dead_letters d WHERE d.event_id = s.event_id)
), deleted AS (
    DELETE FROM {schema}.attempts a
    WHERE NOT %(dry_run)s AND a.ctid = ANY (ARRAY(SELECT row_id FROM doomed))
    RETURNING 1
)
SELECT (SELECT count(*) FROM doomed), (SELECT count(*) FROM deleted), count(*),
       max(occurred_at)
FROM scanned;

-- name: prune_delivery_log
WITH scanned AS (
    SELECT l.ctid AS row_id, l.at
    FROM {schema}.delivery_log l
    WHERE l.at < %(cutoff)s AND l.at > %(after)s
    ORDER BY l.at
    LIMIT %(limit)s
), deleted AS (
    DELETE FROM {schema}.delivery_log l
    WHERE NOT %(dry_run)s AND l.ctid = ANY (ARRAY(SELECT row_id FROM scanned))
    RETURNING 1
)
SELECT count(*), (SELECT count(*) FROM deleted), count(*), max(at)
FROM scanned;

-- name: prune_audit_log
WITH scanned AS (
    SELECT l.ctid AS row_id, l.at
    FROM {schema}.audit_log l
    WHERE l.at < %(cutoff)s AND l.at > %(after)s
    ORDER BY l.at
    LIMIT %(limit)s
), deleted AS (
    DELETE FROM {schema}.audit_log l
    WHERE NOT %(dry_run)s AND l.ctid = ANY (ARRAY(SELECT row_id FROM scanned))
    RETURNING 1
)
SELECT count(*), (SELECT count(*) FROM deleted), count(*), max(at)
FROM scanned;

-- name: prune_audit
-- `pipeline prune` is an operator action: it leaves an audit record (the janitor does not).
INSERT INTO {schema}.audit_log (actor, action, parameters, affected)
VALUES (%(actor)s, 'prune', %(parameters)s::jsonb, %(affected)s);

-- name: table_sizes
-- Planner estimates and on-disk sizes (with indexes and TOAST): catalog reads, no scans.
SELECT c.relname, greatest(c.reltuples, 0)::float8, pg_total_relation_size(c.oid)::float8
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema_name)s AND c.relkind IN ('r', 'p') AND c.relname = ANY (%(tables)s)
ORDER BY c.relname;

-- name: backlog_count
-- Unsent events, counted no further than %(limit)s (the unsent rows' partial index).
SELECT count(*) FROM (
    SELECT 1 FROM {schema}.outbox WHERE status IN ('pending', 'publishing') LIMIT %(limit)s
) AS unsent;
