-- Raw messages (ones that were not readable events, kept in raw_message) are dead-lettered
-- once: each such row records a SHA-256 digest of its queue and raw bytes, and the insert
-- skips a message whose digest is recorded already. A message that comes back after it
-- was recorded (the worker stopped before it removed the message from the broker) is not
-- recorded again. Rows of other dead letters, and those from before this migration, have
-- no digest.
ALTER TABLE dead_letters ADD COLUMN raw_digest bytea;
CREATE UNIQUE INDEX dead_letters_raw_digest_idx ON dead_letters (raw_digest)
    WHERE raw_digest IS NOT NULL;
