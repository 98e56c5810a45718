-- Each relay's and worker process's clock against the database's, measured at every
-- heartbeat: the process's wall time at the midpoint of the heartbeat's round trip minus
-- the clock_timestamp() the heartbeat returned, in seconds (positive: the process's clock
-- is ahead). NULL until a process has measured it (rows of processes that predate it).
-- `pipeline doctor` names a live process whose clock is off by more than a second.
ALTER TABLE relay_state ADD COLUMN clock_offset double precision;
ALTER TABLE worker_state ADD COLUMN clock_offset double precision;
