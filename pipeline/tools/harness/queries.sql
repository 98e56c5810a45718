-- Named queries every order workflow of the harness needs (pipeline/tools/harness/sql.py
-- adds them to the workflow's own). {app} is the business schema, {schema} the pipeline's
-- schema (quoted identifiers); values are %(name)s parameters.

-- name: create_schema
-- A schema of this run's own: fails if it exists, so a run never writes into (or later
-- drops) a schema it did not create.
CREATE SCHEMA {app};

-- name: relays_registered
-- Relays that have registered (a relay writes its row when it starts serving and deletes it
-- when it stops). An idle relay does not refresh its heartbeat, so the heartbeat's age says
-- nothing about whether it runs. With %(pids)s the relays of those processes, else any.
SELECT count(*) FROM {schema}.relay_state
WHERE %(pids)s::int[] IS NULL OR pid = ANY(%(pids)s::int[]);
