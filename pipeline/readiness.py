"""Start and wait: a relay or worker started before its servers (or schema) waits for them.

Processes are started by supervisors that do not order them after Postgres, the broker and
``pipeline db upgrade``. Instead of dying with a traceback, ``pipeline relay`` and
``pipeline worker`` check what they need before they start work and, while something is
missing, log one line per backoff step with the reason and the next wait, until it is
there or they are told to stop. Misconfiguration (a password Postgres refuses, a database
that does not exist) is waited on too, and named in the same lines: an operator may fix it
while the process waits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import psycopg
from psycopg import sql

from pipeline.backoff import Backoff
from pipeline.config import Settings, validate_identifier
from pipeline.db.connect import connect, describe_server, driver_reason, schema_missing_message
from pipeline.db.migrate import available_migrations
from pipeline.db.privileges import STARTUP, require_privileges
from pipeline.errors import PermissionDeniedError, ServiceUnavailableError
from pipeline.transport.factory import broker_problem

log = logging.getLogger("pipeline.readiness")
FIRST_WAIT = 0.5
CHECK_TIMEOUT = 5


def postgres_problem(
    settings: Settings,
    grants: Mapping[str, frozenset[str]] | None = None,
    command: str = "this process",
) -> str | None:
    """Why Postgres cannot serve the pipeline yet (down, refusing, schema missing), or None.

    A role refused the read of the schema version will not be granted it by waiting: that
    raises :class:`PermissionDeniedError` naming every grant of ``grants`` it lacks.
    """
    try:
        conn = connect(settings, autocommit=True, connect_timeout=CHECK_TIMEOUT)
    except ServiceUnavailableError as exc:
        return str(exc)
    schema = validate_identifier(settings.schema_name, "schema name")
    try:
        with conn:
            table = conn.execute(
                "SELECT to_regclass(%s)", (f'"{schema}".schema_migrations',)
            ).fetchone()
            if table is None or table[0] is None:
                return schema_missing_message(schema)
            applied = {
                version
                for (version,) in conn.execute(
                    sql.SQL("SELECT version FROM {}.schema_migrations").format(
                        sql.Identifier(schema)
                    )
                )
            }
    except psycopg.errors.InsufficientPrivilege as exc:
        url = settings.require_database_url()
        if privileges_problem(settings, grants or STARTUP, command) is None:
            raise PermissionDeniedError(  # every grant checked is there, yet a read was refused
                f"permission denied: {driver_reason(exc, url)} (the grants `{command}` needs "
                "are in docs/security.md)"
            ) from None
        return f"cannot use Postgres at {describe_server(url)}: {driver_reason(exc, url)}"
    except psycopg.Error as exc:
        url = settings.require_database_url()
        return f"cannot use Postgres at {describe_server(url)}: {driver_reason(exc, url)}"
    missing = [m.version for m in available_migrations() if m.version not in applied]
    if missing:
        return (
            f"the pipeline schema {schema!r} lacks migrations {missing}: run `pipeline db upgrade`"
        )
    return None


def transport_problem(settings: Settings) -> str | None:
    """Why the message broker (Redis or RabbitMQ, by the URL's scheme) cannot be used yet,
    or None."""
    return broker_problem(settings)


redis_problem = transport_problem  # its name before the broker could be RabbitMQ


def privileges_problem(
    settings: Settings, grants: Mapping[str, frozenset[str]], command: str
) -> str | None:
    """Why the role's grants cannot be checked yet (the connection failed or was killed
    mid-check: an outage like any other), or None once they were checked.

    A grant the role lacks is no outage: :class:`~pipeline.errors.PermissionDeniedError`
    propagates, so the process stops with the one line naming the grants.
    """
    try:
        with connect(settings, connect_timeout=CHECK_TIMEOUT) as conn:
            require_privileges(conn, settings.schema_name, grants, command)
    except ServiceUnavailableError as exc:
        return str(exc)
    except psycopg.OperationalError as exc:
        url = settings.require_database_url()
        return f"cannot use Postgres at {describe_server(url)}: {driver_reason(exc, url)}"
    return None


def wait_for_services(
    settings: Settings,
    *,
    redis_needed: bool,
    stop: threading.Event,
    role: str,
    grants: Mapping[str, frozenset[str]] | None = None,
    checks: Sequence[Callable[[], str | None]] = (),
) -> bool:
    """Block until Postgres (with the schema and, given ``grants``, the role's grants) and,
    if needed, the broker are usable, and each of ``checks`` returns None (a string is an
    outage to wait out, as the server checks; a check raises for what waiting cannot fix).

    ``redis_needed`` (a name kept from before RabbitMQ) asks for the broker, whichever it is.

    Returns False when ``stop`` was set first. Each failed check logs one warning with
    the reason and the wait before the next check; the waits double up to
    ``PIPELINE_RECONNECT_BACKOFF_MAX``. A missing grant raises at once, also when it is
    the read of the schema version that the role is refused.
    """
    backoff = Backoff(FIRST_WAIT, settings.reconnect_backoff_max)
    while not stop.is_set():
        problem = postgres_problem(settings, grants, f"pipeline {role}")
        if problem is None and redis_needed:
            problem = transport_problem(settings)
        if problem is None and grants is not None:
            problem = privileges_problem(settings, grants, f"pipeline {role}")
        for check in checks:
            if problem is None:
                problem = check()
        if problem is None:
            if backoff.reset():
                log.info(f"{role}: every server it needs is ready; starting", extra={"role": role})
            return True
        delay = backoff.next_delay()
        log.warning(
            f"{role} waiting: {problem}; next try in {delay:.1f}s",
            extra={"role": role, "retry_in": delay, "attempt": backoff.failures},
        )
        stop.wait(delay)
    return False
