-- The outbox's ceiling on payload size becomes exactly add_event's limit: the
-- outbox_payload_size trigger of functions.sql (applied after the migrations) refuses a
-- payload over PIPELINE_MAX_PAYLOAD_BYTES's ceiling of compact JSON, measured as add_event
-- measures it, and raises the CHECK violation this constraint raised. The constraint of
-- migration 0005 was looser (it let a payload through up to 1 MiB of JSON text) and ran on
-- every update of a row. Rows already in the outbox are not checked again.
ALTER TABLE outbox DROP CONSTRAINT outbox_payload_size_check;
