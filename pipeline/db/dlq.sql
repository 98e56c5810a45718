-- Named queries of the dead-letter tools (`pipeline dlq`) and the audit log.
-- See queries.sql for the conventions. Every filter is a bound parameter; NULL means
-- "not filtered", so one statement serves every combination of filters.

-- name: dlq_select
-- Dead letters matching the operator's filters. ``caused_by`` takes the causation chain
-- under an event (the event itself and every follow-up event, at any depth) through the
-- outbox's causation index. With ``in_event_order`` the rows come in the events' sequence
-- order (replay keeps each ordering key's original order); otherwise in id order.
-- ``carried``: the event ids inside an unprocessable message's stored arguments, for
-- dead letters that name no single event, and how many of them the consumer has processed.
WITH RECURSIVE chain (id) AS (
    SELECT %(caused_by)s::uuid WHERE %(caused_by)s::uuid IS NOT NULL
    UNION
    SELECT o.id
    FROM chain c
    JOIN {schema}.outbox o ON o.headers ->> 'causation_id' = c.id::text
)
SELECT d.id, d.stage, d.event_id, d.consumer, d.event_type, d.queue, d.reason, d.error_class,
       d.error, d.attempts, d.created_at, d.replayed_at, d.replay_count,
       coalesce(o.seq, CASE WHEN jsonb_typeof(d.envelope -> 'pipelineseq') = 'number'
                            THEN (d.envelope ->> 'pipelineseq')::numeric::bigint END) AS seq,
       coalesce(o.ordering_key, d.envelope ->> 'pipelineorderingkey') AS ordering_key,
       o.status AS outbox_status,
       (SELECT i.status FROM {schema}.inbox i
        WHERE i.consumer = d.consumer AND i.event_id = d.event_id) AS inbox_status,
       carried.ids AS carried, carried.processed AS carried_processed,
       d.envelope IS NOT NULL AND jsonb_typeof(d.envelope -> 'data') IS NOT NULL AS has_envelope
FROM {schema}.dead_letters d
LEFT JOIN {schema}.outbox o ON o.id = d.event_id
LEFT JOIN LATERAL (
    SELECT array_agg(e ->> 'id') AS ids,
           count(*) FILTER (WHERE EXISTS (
               SELECT 1 FROM {schema}.inbox i
               WHERE i.consumer = d.consumer AND i.event_id::text = e ->> 'id'
                 AND i.status = 'processed'
           )) AS processed
    FROM jsonb_array_elements(
        CASE WHEN d.event_id IS NULL AND jsonb_typeof(d.envelope -> 'args' -> 0) = 'array'
             THEN d.envelope -> 'args' -> 0 ELSE '[]'::jsonb END
    ) AS e
    WHERE jsonb_typeof(e) = 'object' AND e ->> 'id' IS NOT NULL
) AS carried ON true
WHERE (%(stage)s::text IS NULL OR d.stage = %(stage)s::text)
  AND (%(consumer)s::text IS NULL OR d.consumer = %(consumer)s::text)
  AND (%(event_type)s::text IS NULL OR d.event_type = %(event_type)s::text)
  AND (%(error_class)s::text IS NULL OR d.error_class = %(error_class)s::text)
  AND (%(since)s::timestamptz IS NULL OR d.created_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR d.created_at < %(until)s::timestamptz)
  AND (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
  AND (%(event_ids)s::uuid[] IS NULL OR d.event_id = ANY(%(event_ids)s::uuid[]))
  AND (%(caused_by)s::uuid IS NULL OR d.event_id IN (SELECT id FROM chain))
  AND (NOT %(waiting)s::boolean OR d.replayed_at IS NULL)
  AND (%(group_ids)s::bigint[] IS NULL OR d.id = ANY(%(group_ids)s::bigint[]))
ORDER BY CASE WHEN %(in_event_order)s::boolean
              THEN coalesce(o.seq, CASE WHEN jsonb_typeof(d.envelope -> 'pipelineseq') = 'number'
                                        THEN (d.envelope ->> 'pipelineseq')::numeric::bigint END)
         END NULLS LAST,
         d.id
LIMIT %(limit)s;

-- name: dlq_groups
-- Dead letters by cause (``pipeline dlq groups``), under the same filters as dlq_select.
-- A group is one failure fingerprint: the first 12 hex digits of the md5 of the stage,
-- consumer, event type, error class and normalised message. The message is the error text
-- without its leading "ErrorClass: ", with quoted values, UUIDs, hex ids (0x..., or 8 or
-- more hex digits mixing letters and digits) and numbers replaced by placeholders,
-- whitespace collapsed, cut at 500 characters. It is computed here, when asked, rather
-- than stored: every dead letter groups alike whichever version wrote it, and the rules
-- can change without a migration; the scan covers the dead letters in scope, which an
-- operator command can afford. This is the one place the fingerprint is computed: a
-- replay or purge of a group reads its members here (``with_ids``), then selects them by id.
WITH RECURSIVE chain (id) AS (
    SELECT %(caused_by)s::uuid WHERE %(caused_by)s::uuid IS NOT NULL
    UNION
    SELECT o.id
    FROM chain c
    JOIN {schema}.outbox o ON o.headers ->> 'causation_id' = c.id::text
), scoped AS (
    SELECT d.id, d.stage, d.consumer, d.event_type, d.error_class, d.created_at,
           d.replayed_at,
           btrim(left(
               regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(
                   CASE WHEN starts_with(d.error, d.error_class || ': ')
                        THEN substr(d.error, length(d.error_class) + 3)
                        ELSE d.error END,
                   '''[^'']*''|"[^"]*"', '<str>', 'g'),
                   '[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}',
                   '<uuid>', 'gi'),
                   '\m(0x[0-9a-f]+|(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{{8,}})\M',
                   '<hex>', 'gi'),
                   '[0-9]+(\.[0-9]+)?', '<n>', 'g'),
                   '\s+', ' ', 'g'),
               500)) AS message
    FROM {schema}.dead_letters d
    WHERE (%(stage)s::text IS NULL OR d.stage = %(stage)s::text)
      AND (%(consumer)s::text IS NULL OR d.consumer = %(consumer)s::text)
      AND (%(event_type)s::text IS NULL OR d.event_type = %(event_type)s::text)
      AND (%(error_class)s::text IS NULL OR d.error_class = %(error_class)s::text)
      AND (%(since)s::timestamptz IS NULL OR d.created_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR d.created_at < %(until)s::timestamptz)
      AND (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
      AND (%(event_ids)s::uuid[] IS NULL OR d.event_id = ANY(%(event_ids)s::uuid[]))
      AND (%(caused_by)s::uuid IS NULL OR d.event_id IN (SELECT id FROM chain))
      AND (NOT %(waiting)s::boolean OR d.replayed_at IS NULL)
), keyed AS (
    SELECT s.*,
           left(md5(concat_ws(chr(31), s.stage, coalesce(s.consumer, ''),
                              coalesce(s.event_type, ''), s.error_class, s.message)),
                12) AS fingerprint
    FROM scoped s
), grouped AS (
    SELECT fingerprint, stage, consumer, event_type, error_class, message,
           count(*) AS total, count(*) FILTER (WHERE replayed_at IS NULL) AS waiting,
           min(created_at) AS first_seen, max(created_at) AS last_seen, min(id) AS sample_id,
           CASE WHEN %(with_ids)s::boolean THEN array_agg(id ORDER BY id) END AS ids
    FROM keyed
    WHERE %(fingerprint)s::text IS NULL OR fingerprint = %(fingerprint)s::text
    GROUP BY fingerprint, stage, consumer, event_type, error_class, message
)
SELECT g.fingerprint, g.stage, g.consumer, g.event_type, g.error_class, g.message, g.total,
       g.waiting, g.first_seen, g.last_seen, g.sample_id, d.error, g.ids
FROM grouped g
JOIN {schema}.dead_letters d ON d.id = g.sample_id
ORDER BY g.total DESC, g.first_seen, g.fingerprint
LIMIT %(limit)s;

-- name: dlq_get
-- One dead letter with everything kept about it (``pipeline dlq show``).
SELECT d.id, d.stage, d.event_id, d.consumer, d.event_type, d.queue, d.reason, d.error_class,
       d.error, d.attempts, d.created_at, d.replayed_at, d.replay_count, d.envelope::text,
       d.raw_message, o.status, o.seq, o.ordering_key,
       (SELECT i.status FROM {schema}.inbox i
        WHERE i.consumer = d.consumer AND i.event_id = d.event_id)
FROM {schema}.dead_letters d
LEFT JOIN {schema}.outbox o ON o.id = d.event_id
WHERE d.id = %(id)s;

-- name: dlq_history
-- The failed attempts behind a dead letter: its event's attempts at its stage (and consumer).
SELECT attempt, error_class, error, occurred_at
FROM {schema}.attempts
WHERE event_id = %(event_id)s AND stage = %(stage)s
  AND consumer IS NOT DISTINCT FROM %(consumer)s::text
ORDER BY occurred_at, id;

-- name: dlq_events
-- Outbox rows of events to deliver again, as the relay reads them (ids keep their identity,
-- so every inbox still recognises a copy it already processed).
SELECT id, seq, aggregate_type, aggregate_id, ordering_key, event_type, event_version,
       payload::text, headers::text, attempts, created_at
FROM {schema}.outbox
WHERE id = ANY(%(event_ids)s::uuid[])
ORDER BY seq;

-- name: dlq_envelope
SELECT envelope::text FROM {schema}.dead_letters WHERE id = %(id)s;

-- name: dlq_lock
-- Take one dead letter for a replay: none back when it was replayed or purged meanwhile.
SELECT id FROM {schema}.dead_letters
WHERE id = %(id)s AND replayed_at IS NULL
FOR UPDATE;

-- name: dlq_requeue_outbox
-- A publish-stage replay: the event is pending again, due now, with a fresh attempt budget;
-- the relay publishes it to its subscribers in its key's sequence order.
UPDATE {schema}.outbox
SET status = 'pending', attempts = 0, next_attempt_at = clock_timestamp(),
    lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
WHERE id = %(event_id)s AND status = 'dead'
RETURNING id;

-- name: dlq_wake_relay
SELECT pg_notify(%(channel)s, '');

-- name: dlq_requeue_inbox
-- A consume-stage replay: the (consumer, event) rows are owed again (pending, no attempts
-- so far, delivered now), so the ledger sweep sends them again should the replayed message
-- be lost. Rows already processed are left alone (nothing is owed); their ids do not come back.
INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq, status,
                                 attempts, delivered_at)
SELECT %(consumer)s, e.event_id, e.event_type, e.ordering_key, e.seq, 'pending', 0,
       clock_timestamp()
FROM unnest(%(event_ids)s::uuid[], %(event_types)s::text[], %(ordering_keys)s::text[],
            %(seqs)s::bigint[]) AS e (event_id, event_type, ordering_key, seq)
ORDER BY e.event_id
ON CONFLICT (consumer, event_id) DO UPDATE
SET status = 'pending', attempts = 0, delivered_at = clock_timestamp()
WHERE i.status <> 'processed'
RETURNING event_id;

-- name: dlq_mark_replayed
UPDATE {schema}.dead_letters
SET replayed_at = clock_timestamp(), replay_count = replay_count + 1
WHERE id = %(id)s;

-- name: dlq_delete
DELETE FROM {schema}.dead_letters WHERE id = ANY(%(ids)s::bigint[]) RETURNING id;

-- name: audit_insert
INSERT INTO {schema}.audit_log (actor, action, parameters, affected)
VALUES (%(actor)s, %(action)s, %(parameters)s::jsonb, 0)
RETURNING id;

-- name: audit_affected
-- Count dead letters into an audit record in the transaction that acts on them, so the
-- record holds what was done even when the command is interrupted. The first
-- ``max_listed`` ids are listed.
UPDATE {schema}.audit_log
SET affected = affected + cardinality(%(ids)s::bigint[]),
    parameters = parameters || jsonb_build_object(
        'dead_letters',
        coalesce(parameters -> 'dead_letters', '[]'::jsonb) || coalesce((
            SELECT jsonb_agg(x)
            FROM unnest(%(ids)s::bigint[]) WITH ORDINALITY AS u (x, n)
            WHERE coalesce(jsonb_array_length(parameters -> 'dead_letters'), 0) + n
                  <= %(max_listed)s
        ), '[]'::jsonb))
WHERE id = %(audit_id)s;

-- name: audit_list
SELECT id, at, actor, action, parameters::text, affected
FROM {schema}.audit_log
ORDER BY id DESC
LIMIT %(limit)s;

-- name: dlq_known_ids
SELECT id FROM {schema}.dead_letters WHERE id = ANY(%(ids)s::bigint[]);

-- name: audit_add_affected
-- Count rows other than dead letters (abandoned deliveries) into an audit record, in the
-- transaction that changes them.
UPDATE {schema}.audit_log SET affected = affected + %(count)s WHERE id = %(audit_id)s;
