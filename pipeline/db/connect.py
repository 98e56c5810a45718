"""Connections and engines built from settings.

A connection that cannot be opened raises :class:`~pipeline.errors.ServiceUnavailableError`
(or :class:`~pipeline.errors.ConfigurationError` for a URL libpq cannot parse) whose
message names the server without its password, through the one seam that words driver
errors, :mod:`pipeline.driver_errors`; its wording helpers are re-exported here for the
processes that report connection trouble while they retry.

Every connection made here bounds its waits (:func:`session_settings`): a
``lock_timeout`` and a ``statement_timeout``, an ``idle_in_transaction_session_timeout``
so that a stopped process's open transaction ends and releases its locks, and TCP
keepalives on both ends, so that a backend whose client died or was cut off by a
partition is reaped and a client whose server vanished notices. A statement that hits a
timeout fails with :class:`psycopg.errors.LockNotAvailable` or
:class:`psycopg.errors.QueryCanceled`; long-running processes retry it.
"""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event

from pipeline.config import Settings
from pipeline.driver_errors import (
    SCHEMA_MISSING,
    describe_server,
    driver_reason,
    permission_denied,
    schema_missing_message,
    wrap_driver_errors,
)

__all__ = [
    "SCHEMA_MISSING",
    "bound_session",
    "connect",
    "describe_server",
    "driver_reason",
    "keepalive_parameters",
    "make_engine",
    "permission_denied",
    "schema_missing_message",
    "session_settings",
]

KEEPALIVE_PROBES = 3
"""Unanswered keepalive probes after which a peer counts as gone."""


def session_settings(settings: Settings, *, timeouts: bool = True) -> dict[str, str]:
    """The server settings that bound a session's waits (see the module docstring), by name.

    ``timeouts=False`` (schema migrations, which may rightly wait for their locks and run
    long) keeps only the keepalives. A setting at 0 is left out (the server's own stands).
    """
    values: dict[str, int] = {}
    if timeouts:
        values["lock_timeout"] = settings.lock_timeout_ms
        values["statement_timeout"] = settings.statement_timeout_ms
        values["idle_in_transaction_session_timeout"] = settings.idle_in_transaction_timeout_ms
    idle = settings.tcp_keepalives_idle_seconds
    if idle:
        values.update(
            tcp_keepalives_idle=idle,
            tcp_keepalives_interval=max(1, idle // 2),
            tcp_keepalives_count=KEEPALIVE_PROBES,
        )
    return {name: str(value) for name, value in values.items() if value}


def keepalive_parameters(settings: Settings) -> dict[str, Any]:
    """libpq's TCP keepalive parameters: the client's end of the keepalives."""
    idle = settings.tcp_keepalives_idle_seconds
    if not idle:
        return {}
    return {
        "keepalives": 1,
        "keepalives_idle": idle,
        "keepalives_interval": max(1, idle // 2),
        "keepalives_count": KEEPALIVE_PROBES,
    }


def bound_session(conn: Any, values: dict[str, str]) -> None:
    """Apply ``values`` to the session of ``conn`` (a psycopg connection) in one statement.

    Session-level ``SET`` rather than the startup packet's ``options``, which PgBouncer
    refuses for settings it does not track. Behind a transaction-pooling PgBouncer the
    settings reach whichever server connection ran the statement: there, set the
    ``PIPELINE_*_TIMEOUT_MS`` settings to 0 and the timeouts on the role instead
    (``ALTER ROLE … SET lock_timeout = …``).
    """
    if not values:
        return
    with conn.cursor() as cursor:
        cursor.execute(
            "SELECT set_config(s.name, s.value, false) "
            "FROM unnest(%s::text[], %s::text[]) AS s (name, value)",
            (list(values), list(values.values())),
        )
    if not conn.autocommit:
        conn.commit()


def connect(
    settings: Settings,
    *,
    autocommit: bool = False,
    connect_timeout: int = 10,
    timeouts: bool = True,
    **kwargs: Any,
) -> psycopg.Connection[Any]:
    """A psycopg connection to the configured database, its waits bounded."""
    url = settings.require_database_url()
    with wrap_driver_errors(settings, "connect to"):
        params = keepalive_parameters(settings) | kwargs
        conn = psycopg.connect(
            url, autocommit=autocommit, connect_timeout=connect_timeout, **params
        )
        try:
            bound_session(conn, session_settings(settings, timeouts=timeouts))
        except BaseException:
            conn.close()
            raise
        return conn


def make_engine(settings: Settings, *, timeouts: bool = True, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine on psycopg 3 for the configured database, its waits bounded.

    ``hide_parameters``: SQLAlchemy's errors otherwise quote the statement's parameters —
    event payloads — and those errors reach logs (a worker whose connection died).
    """
    engine = create_engine(
        settings.sqlalchemy_url(),
        connect_args={"connect_timeout": 10, **keepalive_parameters(settings)},
        hide_parameters=True,
        **kwargs,
    )
    values = session_settings(settings, timeouts=timeouts)

    @event.listens_for(engine, "connect")
    def _bound(dbapi_connection: Any, _record: Any) -> None:
        bound_session(dbapi_connection, values)

    return engine
