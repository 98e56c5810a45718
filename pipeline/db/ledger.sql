-- Named queries of the delivery ledger: what each consumer is still owed, and its sweep.
-- See queries.sql for the conventions. An event marked sent carries the consumers it was
-- delivered to (outbox.consumers); the inbox row (consumer, event_id) holds the outcome.
-- A delivery is owed while that row is missing or unfinished ('pending', 'failed').

-- name: ledger_lock
-- One sweep at a time across relays; the lock ends with the sweep's transaction.
SELECT pg_try_advisory_xact_lock(hashtext('pipeline.ledger.' || %(schema_name)s));

-- name: ledger_window
-- How far earlier sweeps looked at sent events (the row is created by the migration;
-- recreated here if someone deleted it).
INSERT INTO {schema}.delivery_sweep AS s (id) VALUES (true)
ON CONFLICT (id) DO UPDATE SET id = s.id
RETURNING s.swept_to, clock_timestamp() - make_interval(secs => %(horizon)s);

-- name: ledger_clock
-- The database's clock: when a relay noticed the broker's loss, on the ledger's own clock.
SELECT clock_timestamp();

-- name: ledger_account
-- Sent events that reached the horizon without any outcome for one of their consumers
-- (no inbox row at all: the copy never arrived, or Redis forgot it) get a 'pending' inbox
-- row dated at publication, so the owed-delivery query below finds them. The window
-- starts a little before the last sweep's end (``since``) to cover any sent mark whose
-- transaction committed late; rows already recorded are skipped.
INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq, status,
                                 delivered_at)
SELECT c.consumer, o.id, o.event_type, o.ordering_key, o.seq, 'pending', o.published_at
FROM {schema}.outbox o
CROSS JOIN LATERAL unnest(o.consumers) AS c (consumer)
WHERE o.status = 'sent' AND o.published_at > %(since)s AND o.published_at <= %(until)s
  AND NOT EXISTS (
      SELECT 1 FROM {schema}.inbox x WHERE x.consumer = c.consumer AND x.event_id = o.id
  )
ON CONFLICT (consumer, event_id) DO NOTHING;

-- name: ledger_unaccounted
-- What ledger_account would record, one delivery a row in publication order: its
-- row-by-row form, used when a worker's claim of one of them (an inbox row inserted by a
-- transaction still open) holds the one-statement form up.
SELECT c.consumer, o.id, o.published_at
FROM {schema}.outbox o
CROSS JOIN LATERAL unnest(o.consumers) AS c (consumer)
WHERE o.status = 'sent' AND o.published_at > %(since)s AND o.published_at <= %(until)s
  AND NOT EXISTS (
      SELECT 1 FROM {schema}.inbox x WHERE x.consumer = c.consumer AND x.event_id = o.id
  )
ORDER BY o.published_at, o.id;

-- name: ledger_account_one
-- One delivery of ledger_unaccounted recorded as owed (as ledger_account does).
INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq, status,
                                 delivered_at)
SELECT %(consumer)s, o.id, o.event_type, o.ordering_key, o.seq, 'pending', o.published_at
FROM {schema}.outbox o
WHERE o.id = %(event_id)s
ON CONFLICT (consumer, event_id) DO NOTHING;

-- name: ledger_lock_wait
-- Set the transaction's lock_timeout (wait); returns the one it replaces.
SELECT current_setting('lock_timeout'), set_config('lock_timeout', %(wait)s, true);

-- name: ledger_advance
UPDATE {schema}.delivery_sweep SET swept_to = %(until)s, sweeps = sweeps + 1 WHERE id;

-- name: ledger_owed
-- Deliveries owed past the horizon, oldest first, to the consumers this relay can route
-- to, each no later than its consumer's ``cutoff`` (deliveries younger than the oldest
-- message still waiting on the consumer's queue may be in that queue: not owed yet).
-- Rows a worker is processing right now are locked: skipped. A row the relay recorded
-- before publishing (inbox_expect) is owed only once its event is sent, and only if the
-- event was published before the cutoff too (a row may predate a later attempt's
-- publication); a row whose event is gone is owed (and dead-lettered as vanished). For
-- ordered consumers, an event waits behind an unfinished predecessor that is not itself
-- owed (it is still on its way, or its retry is due later): the predecessor's own
-- delivery carries the key. The event rows come along, so the sweep can deliver them
-- again as the relay does.
WITH cutoffs AS (
    SELECT * FROM unnest(%(consumers)s::text[], %(cutoffs)s::timestamptz[],
                         %(ordered)s::boolean[]) AS c (consumer, cutoff, ordered)
), owed AS (
    SELECT i.consumer, i.event_id, c.ordered, i.status, i.redeliveries
    FROM {schema}.inbox i
    JOIN cutoffs c ON c.consumer = i.consumer
    WHERE i.status IN ('pending', 'failed') AND i.delivered_at <= c.cutoff
      AND NOT EXISTS (
          SELECT 1 FROM {schema}.outbox e
          WHERE e.id = i.event_id AND (e.status <> 'sent' OR e.published_at > c.cutoff)
      )
      AND (NOT c.ordered OR i.ordering_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM {schema}.inbox p
          WHERE p.consumer = i.consumer AND p.ordering_key = i.ordering_key
            AND p.status IN ('pending', 'failed') AND p.seq < i.seq
            AND (p.delivered_at > c.cutoff OR EXISTS (
                SELECT 1 FROM {schema}.outbox pe
                WHERE pe.id = p.event_id
                  AND (pe.status <> 'sent' OR pe.published_at > c.cutoff)
            ))
      ))
    ORDER BY i.delivered_at
    LIMIT %(limit)s
    FOR UPDATE OF i SKIP LOCKED
)
SELECT owed.consumer, owed.event_id, owed.status, owed.redeliveries, o.seq, o.aggregate_type, o.aggregate_id, o.ordering_key,
       o.event_type, o.event_version, o.payload::text, o.headers::text, o.attempts,
       o.created_at
FROM owed
LEFT JOIN {schema}.outbox o ON o.id = owed.event_id;

-- name: ledger_redelivered
-- Each delivery sent again is also logged (delivery_log), for `pipeline status`.
WITH redelivered AS (
    UPDATE {schema}.inbox i
    SET delivered_at = clock_timestamp(), redeliveries = i.redeliveries + 1
    FROM unnest(%(consumers)s::text[], %(event_ids)s::uuid[]) AS r (consumer, event_id)
    WHERE i.consumer = r.consumer AND i.event_id = r.event_id
    RETURNING i.consumer, i.event_id
)
INSERT INTO {schema}.delivery_log (consumer, event_id, kind)
SELECT consumer, event_id, 'redelivery' FROM redelivered;

-- name: ledger_vanished
-- An owed delivery whose event is no longer in the outbox cannot be sent again: finished
-- for its consumer, and dead-lettered so that an operator sees it.
WITH gone AS (
    UPDATE {schema}.inbox i
    SET status = 'dead', last_error = 'event no longer in the outbox',
        last_error_class = 'EventVanished'
    FROM unnest(%(consumers)s::text[], %(event_ids)s::uuid[]) AS r (consumer, event_id)
    WHERE i.consumer = r.consumer AND i.event_id = r.event_id
      AND i.status IN ('pending', 'failed')
    RETURNING i.consumer, i.event_id, i.event_type
)
INSERT INTO {schema}.dead_letters (stage, event_id, consumer, event_type, reason,
                                   error_class, error)
SELECT 'consume', event_id, consumer, event_type, 'event no longer in the outbox',
       'EventVanished', 'owed delivery whose event row is gone'
FROM gone;

-- name: ledger_state
-- What `pipeline status` and the relay's gauges report: per consumer, deliveries owed past
-- the horizon (recorded in the inbox, or sent events the sweep has not looked at yet), and
-- keys with later unfinished events held behind such a delivery (ordered consumers).
WITH cutoff AS (
    SELECT clock_timestamp() - make_interval(secs => %(horizon)s) AS at
), recorded AS (
    SELECT i.consumer, count(*) AS owed,
           count(DISTINCT i.ordering_key) FILTER (WHERE EXISTS (
               SELECT 1 FROM {schema}.inbox later
               WHERE later.consumer = i.consumer AND later.ordering_key = i.ordering_key
                 AND later.status IN ('pending', 'failed') AND later.seq > i.seq
           )) AS keys
    FROM {schema}.inbox i, cutoff
    WHERE i.status IN ('pending', 'failed') AND i.delivered_at <= cutoff.at
      AND NOT EXISTS (
          SELECT 1 FROM {schema}.outbox e
          WHERE e.id = i.event_id AND (e.status <> 'sent' OR e.published_at > cutoff.at)
      )
    GROUP BY i.consumer
), unswept AS (
    SELECT c.consumer, count(*) AS owed
    FROM {schema}.outbox o
    CROSS JOIN LATERAL unnest(o.consumers) AS c (consumer)
    CROSS JOIN cutoff
    WHERE o.status = 'sent'
      AND o.published_at > (SELECT swept_to FROM {schema}.delivery_sweep WHERE id)
      AND o.published_at <= cutoff.at
      AND NOT EXISTS (
          SELECT 1 FROM {schema}.inbox x WHERE x.consumer = c.consumer AND x.event_id = o.id
      )
    GROUP BY c.consumer
)
SELECT coalesce(r.consumer, u.consumer), coalesce(r.owed, 0) + coalesce(u.owed, 0),
       coalesce(r.keys, 0)
FROM recorded r FULL JOIN unswept u ON u.consumer = r.consumer
ORDER BY 1;

-- name: ledger_owed_list
-- `pipeline dlq owed`: deliveries owed, oldest first: unfinished inbox rows last delivered
-- at least ``min_age`` seconds ago, and sent events the sweep has not recorded yet for one
-- of their consumers (no inbox row; ``recorded`` false). The first ``limit`` rows come, and
-- each consumer's oldest one besides, with per-consumer totals on every row.
WITH cutoff AS (
    SELECT clock_timestamp() AS now,
           clock_timestamp() - make_interval(secs => %(min_age)s) AS at
), owed AS (
    SELECT i.consumer, i.event_id, i.event_type, i.status, true AS recorded,
           i.delivered_at AS since, i.attempts, i.redeliveries
    FROM {schema}.inbox i, cutoff
    WHERE i.status IN ('pending', 'failed') AND i.delivered_at <= cutoff.at
      AND (%(consumer)s::text IS NULL OR i.consumer = %(consumer)s::text)
    UNION ALL
    SELECT c.consumer, o.id, o.event_type, 'pending', false, o.published_at, 0, 0
    FROM {schema}.outbox o
    CROSS JOIN LATERAL unnest(o.consumers) AS c (consumer)
    CROSS JOIN cutoff
    WHERE o.status = 'sent'
      AND o.published_at > (SELECT swept_to FROM {schema}.delivery_sweep WHERE id)
                           - make_interval(secs => %(overlap)s)
      AND o.published_at <= cutoff.at
      AND (%(consumer)s::text IS NULL OR c.consumer = %(consumer)s::text)
      AND NOT EXISTS (
          SELECT 1 FROM {schema}.inbox x WHERE x.consumer = c.consumer AND x.event_id = o.id
      )
), ranked AS (
    SELECT owed.*, extract(epoch FROM cutoff.now - owed.since)::float8 AS age,
           row_number() OVER (ORDER BY owed.since, owed.event_id) AS overall,
           row_number() OVER (PARTITION BY owed.consumer ORDER BY owed.since, owed.event_id)
               AS within,
           count(*) OVER (PARTITION BY owed.consumer) AS consumer_total
    FROM owed, cutoff
)
SELECT consumer, event_id, event_type, status, recorded, since, age, attempts, redeliveries,
       consumer_total, overall <= %(limit)s AS listed
FROM ranked
WHERE overall <= %(limit)s OR within = 1
ORDER BY since, event_id;

-- name: ledger_abandon
-- `pipeline dlq abandon`: deliveries owed to a consumer that no longer exists are finished
-- for it, at most ``batch`` of each kind per call (one transaction each): its unfinished
-- inbox rows become 'dead' (error class DeliveryAbandoned), and so do the sent events the
-- sweep has not recorded for it yet (a 'dead' row is written), so that neither the owed
-- gauge nor the sweep counts them again. No dead letter is written: an operator decided,
-- and the audit log records it.
WITH unfinished AS (
    SELECT i.event_id
    FROM {schema}.inbox i
    WHERE i.consumer = %(consumer)s AND i.status IN ('pending', 'failed')
    ORDER BY i.delivered_at
    LIMIT %(batch)s
    FOR UPDATE
), recorded AS (
    UPDATE {schema}.inbox i
    SET status = 'dead', last_error = %(error)s, last_error_class = 'DeliveryAbandoned'
    FROM unfinished u
    WHERE i.consumer = %(consumer)s AND i.event_id = u.event_id
    RETURNING i.event_id
), unrecorded AS (
    INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq, status,
                                     last_error, last_error_class, delivered_at)
    SELECT %(consumer)s, o.id, o.event_type, o.ordering_key, o.seq, 'dead', %(error)s,
           'DeliveryAbandoned', o.published_at
    FROM {schema}.outbox o
    WHERE o.status = 'sent' AND %(consumer)s::text = ANY(o.consumers)
      AND o.published_at > (SELECT swept_to FROM {schema}.delivery_sweep WHERE id)
                           - make_interval(secs => %(overlap)s)
      AND NOT EXISTS (
          SELECT 1 FROM {schema}.inbox x WHERE x.consumer = %(consumer)s AND x.event_id = o.id
      )
    ORDER BY o.seq
    LIMIT %(batch)s
    ON CONFLICT (consumer, event_id) DO NOTHING
    RETURNING i.event_id
)
SELECT (SELECT count(*) FROM recorded), (SELECT count(*) FROM unrecorded);
