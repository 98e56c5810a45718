-- Each running worker process's heartbeat, as relay_state holds the relays': a live worker
-- refreshes its row every couple of seconds, busy or idle, and deletes it when it stops, so
-- `pipeline status` and `pipeline doctor` tell alive, stale and gone workers apart on every
-- transport (the broker's own heartbeats are also written by publishers).
CREATE TABLE worker_state (
    worker_id text PRIMARY KEY,
    busy boolean NOT NULL DEFAULT false,
    heartbeat_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    host text NOT NULL,
    pid integer NOT NULL
);
