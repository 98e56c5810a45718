-- Dead letters recorded for a delivered Dramatiq message (arguments its consumer cannot
-- take, an unauthentic or unreadable envelope in it, an unknown actor, infrastructure
-- retries exhausted) are recorded once: each such row records a SHA-256 digest of the
-- message's queue, id, content and which of its dead letters it is, and the insert skips
-- one whose digest is recorded already. A message that comes back after it was recorded
-- (the worker stopped before it removed the message from the broker, or Dramatiq retried
-- it after an outage) is not recorded again. Raw messages keep raw_digest (migration 10);
-- a handler's dead letter is recorded once by its inbox row (inbox_pkey). Rows from before
-- this migration have no message digest.
ALTER TABLE dead_letters ADD COLUMN message_digest bytea;
CREATE UNIQUE INDEX dead_letters_message_digest_idx ON dead_letters (message_digest)
    WHERE message_digest IS NOT NULL;
