-- Named queries of the inbox (consumer side). See queries.sql for the conventions.

-- name: inbox_claim
-- Claim (consumer, event) for this attempt, in the handler's own transaction. Returns the
-- attempt number, or NULL when the event was already processed or dead-lettered (a
-- duplicate). A concurrent copy waits on the row lock and then sees the outcome, but for
-- %(claim_wait_ms)s ms at most, or the usual lock_timeout if shorter (for this statement only: `wait` lowers it before
-- the row is inserted and the outer SELECT puts the transaction's own back after): a copy
-- held by a stuck worker's open transaction fails the claim at once (lock_not_available),
-- so the message is given back instead of holding a worker thread for the full timeout.
WITH wait AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS usual,
           set_config('lock_timeout', CASE
               WHEN current_setting('lock_timeout')::interval
                    BETWEEN '1 microsecond' AND make_interval(secs => %(claim_wait_ms)s / 1e3)
               THEN current_setting('lock_timeout') ELSE %(claim_wait_ms)s || 'ms' END, true)
), claimed AS (
    INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq,
                                     status, attempts, processed_at)
    SELECT %(consumer)s, %(event_id)s, %(event_type)s, %(ordering_key)s, %(seq)s,
           'processed', 1, clock_timestamp()
    FROM wait
    ON CONFLICT (consumer, event_id) DO UPDATE
    SET status = 'processed', attempts = i.attempts + 1, processed_at = clock_timestamp()
    WHERE i.status IN ('pending', 'failed')
    RETURNING attempts
)
SELECT claimed.attempts, set_config('lock_timeout', wait.usual, true)
FROM wait LEFT JOIN claimed ON true;

-- name: inbox_claim_many
-- inbox_claim for all the events of a message at once (unordered consumers): one row, the
-- claimed events' ids and attempt numbers as two arrays in the same order (one NULL each
-- when none was claimed: all already processed or dead-lettered); the same bounded wait as
-- inbox_claim for every event. The aggregate consumes every inserted row before its
-- set_config puts the usual lock_timeout back (a row-by-row select would restore it after
-- the first claim). Keys are locked in event-id order, so two copies cannot deadlock.
WITH wait AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS usual,
           set_config('lock_timeout', CASE
               WHEN current_setting('lock_timeout')::interval
                    BETWEEN '1 microsecond' AND make_interval(secs => %(claim_wait_ms)s / 1e3)
               THEN current_setting('lock_timeout') ELSE %(claim_wait_ms)s || 'ms' END, true)
), claimed AS (
    INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq,
                                     status, attempts, processed_at)
    SELECT %(consumer)s, e.event_id, e.event_type, e.ordering_key, e.seq, 'processed', 1,
           clock_timestamp()
    FROM wait, unnest(%(event_ids)s::uuid[], %(event_types)s::text[],
                      %(ordering_keys)s::text[], %(seqs)s::bigint[])
                 AS e (event_id, event_type, ordering_key, seq)
    ORDER BY e.event_id
    ON CONFLICT (consumer, event_id) DO UPDATE
    SET status = 'processed', attempts = i.attempts + 1, processed_at = clock_timestamp()
    WHERE i.status IN ('pending', 'failed')
    RETURNING event_id, attempts
)
SELECT array_agg(claimed.event_id), array_agg(claimed.attempts),
       set_config('lock_timeout', wait.usual, true)
FROM wait LEFT JOIN claimed ON true
GROUP BY wait.usual;

-- name: inbox_fail
-- Record a failed attempt (after rolling back the handler's savepoint); returns the attempt.
-- delivered_at becomes the time the retry is due: the retry's message is owed from then on
-- (ledger.sql), so a retry that Redis forgets is sent again after the horizon.
WITH upserted AS (
    INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq, status,
                                     attempts, last_error, last_error_class, delivered_at)
    VALUES (%(consumer)s, %(event_id)s, %(event_type)s, %(ordering_key)s, %(seq)s, %(status)s, 1,
            %(error)s, %(error_class)s,
            clock_timestamp() + make_interval(secs => %(retry_in)s))
    ON CONFLICT (consumer, event_id) DO UPDATE
    SET status = excluded.status, attempts = i.attempts + 1,
        last_error = excluded.last_error, last_error_class = excluded.last_error_class,
        delivered_at = excluded.delivered_at
    WHERE i.status IN ('pending', 'failed')
    RETURNING attempts
), history AS (
    INSERT INTO {schema}.attempts (event_id, stage, consumer, attempt, error_class, error)
    SELECT %(event_id)s, 'consume', %(consumer)s, attempts, %(error_class)s, %(error)s
    FROM upserted
)
SELECT attempts FROM upserted;

-- name: inbox_dead_letter
-- A raw message carries the digest of its queue and bytes, a dead letter recorded for a
-- delivered message the digest of its queue, id, content and part (message_digest): one
-- recorded already (the message came back before the broker let go of it) is not
-- recorded again: no row is inserted. (No RETURNING: a consuming role may insert dead
-- letters without reading them.)
INSERT INTO {schema}.dead_letters (stage, event_id, consumer, event_type, queue, reason,
                                   error_class, error, attempts, envelope, raw_message,
                                   raw_digest, message_digest)
VALUES ('consume', %(event_id)s, %(consumer)s, %(event_type)s, %(queue)s, %(reason)s,
        %(error_class)s, %(error)s, %(attempts)s, %(envelope)s::jsonb, %(raw_message)s,
        %(raw_digest)s, %(message_digest)s)
ON CONFLICT DO NOTHING;

-- name: inbox_predecessor_unfinished
-- Ordered consumers: is an earlier event of this key delivered here but not yet done?
SELECT EXISTS (
    SELECT 1 FROM {schema}.inbox
    WHERE consumer = %(consumer)s AND ordering_key = %(ordering_key)s
      AND status IN ('pending', 'failed') AND seq < %(seq)s
);

-- name: inbox_expect
-- The relay records deliveries to ordered consumers, so that a later event of a key can
-- tell that an earlier one is still on its way. It commits them before it hands the
-- events to the broker, so no worker can hold such a row yet, and it never waits on one a
-- worker holds: rows that exist already (an event claimed again) are left alone. A row
-- recorded here does not mean the event went out: only a sent event's rows are owed
-- (ledger.sql). Commits asynchronously, as the claim does: a lost row is one a later claim
-- of the event records again, and no later event of its key is claimed before that.
INSERT INTO {schema}.inbox AS i (consumer, event_id, event_type, ordering_key, seq, status)
SELECT e.consumer, e.event_id, e.event_type, e.ordering_key, e.seq, e.status
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit,
     unnest(%(consumers)s::text[], %(event_ids)s::uuid[], %(event_types)s::text[],
            %(ordering_keys)s::text[], %(seqs)s::bigint[], %(statuses)s::text[])
     AS e (consumer, event_id, event_type, ordering_key, seq, status)
WHERE NOT EXISTS (
    SELECT 1 FROM {schema}.inbox x WHERE x.consumer = e.consumer AND x.event_id = e.event_id
)
ON CONFLICT (consumer, event_id) DO NOTHING;

-- name: inbox_unexpect
-- Events dead-lettered at publish never reached their ordered consumers: the rows
-- inbox_expect recorded for them (still untouched by any worker) stop ordering their keys
-- (no seq), so that later events of their keys do not wait for them. The rows stay, so a
-- replayed event is still recognised once processed. Rows a worker holds are left alone.
UPDATE {schema}.inbox i
SET seq = NULL, last_error = 'dead-lettered at publish', last_error_class = 'DeadAtPublish'
WHERE (i.consumer, i.event_id) IN (
    SELECT x.consumer, x.event_id FROM {schema}.inbox x
    WHERE x.event_id = ANY(%(ids)s) AND x.status = 'pending' AND x.attempts = 0
      AND EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.id = x.event_id AND o.status = 'dead')
    FOR UPDATE SKIP LOCKED
);

-- name: inbox_give_up
-- A delivered event that was dead-lettered as a message (unreadable envelope, redelivery
-- exhausted) is finished for its consumer: later events of its key must not wait for it.
UPDATE {schema}.inbox
SET status = 'dead', last_error = %(error)s, last_error_class = 'UnprocessableMessage'
WHERE consumer = %(consumer)s AND event_id = ANY(%(event_ids)s) AND status IN ('pending', 'failed');

-- name: inbox_log_duplicates
-- Deliveries acknowledged without running the handler (already processed or dead-lettered,
-- or the same event twice in one message), for `pipeline status`; only duplicates pay.
INSERT INTO {schema}.delivery_log (consumer, event_id, kind)
SELECT %(consumer)s, e.event_id, 'duplicate' FROM unnest(%(event_ids)s::uuid[]) AS e (event_id);
