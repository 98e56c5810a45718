-- Only follow-up events carry a causation id; indexing the NULLs of every other event cost
-- an index entry on each insert and each status change of the relay's hot path.
-- `pipeline trace` looks children up by `headers ->> 'causation_id' = ...`, which implies
-- the predicate, so it still uses the index.
DROP INDEX outbox_causation_idx;
CREATE INDEX outbox_causation_idx ON outbox ((headers ->> 'causation_id'))
    WHERE (headers ->> 'causation_id') IS NOT NULL;
