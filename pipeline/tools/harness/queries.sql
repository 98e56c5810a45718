-- Named queries every order workflow of the harness needs (pipeline/tools/harness/sql.py
-- adds them to the workflow's own). {app} is the business schema, {schema} the pipeline's
-- schema (quoted identifiers); values are %(name)s parameters.

-- name: create_schema
-- A schema of this run's own: fails if it exists, so a run never writes into (or later
-- drops) a schema it did not create.
CREATE SCHEMA {app};

-- name: relays_alive
SELECT count(*) FROM {schema}.relay_state
WHERE heartbeat_at > clock_timestamp() - interval '10 seconds';
