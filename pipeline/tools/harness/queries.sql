-- Named queries every order workflow of the harness needs (pipeline/tools/harness/sql.py
-- adds them to the workflow's own). {app} is the business schema, {schema} the pipeline's
-- schema (quoted identifiers); values are %(name)s parameters.

-- name: create_schema
-- A schema of this run's own: fails if it exists, so a run never writes into (or later
-- drops) a schema it did not create.
CREATE SCHEMA {app};

-- name: relays_registered
-- Live relays: a relay writes its row when it starts serving, refreshes its heartbeat every
-- couple of seconds (busy or idle) and deletes the row when it stops; a row whose heartbeat
-- is %(stale)s seconds old belongs to a relay that is stale or gone (killed, stuck), which
-- does not count. With %(pids)s the relays of those processes, else any.
SELECT count(*) FROM {schema}.relay_state
WHERE (%(pids)s::int[] IS NULL OR pid = ANY(%(pids)s::int[]))
  AND heartbeat_at > clock_timestamp() - make_interval(secs => %(stale)s);
