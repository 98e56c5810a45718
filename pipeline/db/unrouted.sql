-- Events sent to no consumer (outbox.consumers empty), and the event types waiting to be
-- published: what the relay checks before it starts, `pipeline status` counts and
-- `pipeline dlq unrouted` / `resend-unrouted` list and send again.
-- {schema} is replaced by the quoted schema identifier; values are %(name)s parameters.

-- name: unsent_event_types
-- The event types of the events waiting to be published (pending or being published).
SELECT event_type, count(*) FROM {schema}.outbox
WHERE status IN ('pending', 'publishing')
GROUP BY event_type
ORDER BY event_type;

-- name: unrouted_counts
SELECT event_type, count(*) FROM {schema}.outbox
WHERE status = 'sent' AND consumers = '{{}}'::text[]
GROUP BY event_type
ORDER BY event_type;

-- name: unrouted_list
-- Oldest first; %(event_types)s NULL for every type.
SELECT id, seq, event_type, aggregate_type, aggregate_id, ordering_key, created_at,
       published_at
FROM {schema}.outbox
WHERE status = 'sent' AND consumers = '{{}}'::text[]
  AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
ORDER BY seq
LIMIT %(limit)s;

-- name: unrouted_resend
-- Back to pending, due now, with a fresh attempt budget: the relay publishes them to the
-- consumers that subscribe to their types now (in their keys' sequence order).
UPDATE {schema}.outbox
SET status = 'pending', attempts = 0, next_attempt_at = clock_timestamp(),
    published_at = NULL, consumers = NULL,
    lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
WHERE id = ANY(%(ids)s::uuid[]) AND status = 'sent' AND consumers = '{{}}'::text[]
RETURNING id;

-- name: unrouted_audit_affected
-- Count events sent again into an operator action's audit record (in the transaction that
-- sends them again).
UPDATE {schema}.audit_log SET affected = affected + %(count)s WHERE id = %(audit_id)s;

-- name: unrouted_wake_relay
SELECT pg_notify(%(channel)s, '');
