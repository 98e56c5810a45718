-- The database's own ceiling on an outbox payload, whatever role writes the row.
--
-- add_event refuses a payload over PIPELINE_MAX_PAYLOAD_BYTES (at most 512 KiB of
-- compact JSON) before any SQL; this CHECK stops a role that inserts rows directly from
-- skipping that limit. It measures jsonb's text form (which adds a space after each ','
-- and ':'), so its 1 MiB leaves room for any payload add_event accepts. Converting jsonb
-- to text costs a measurable time per row, so it is done only for a payload whose stored
-- (binary, uncompressed) size is over 256 KiB: ordinary events pay one size read.
ALTER TABLE outbox
    ADD CONSTRAINT outbox_payload_size_check
    CHECK (pg_column_size(payload) <= 262144 OR octet_length(payload::text) <= 1048576);
