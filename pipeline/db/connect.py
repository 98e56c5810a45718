"""Connections and engines built from settings.

A connection that cannot be opened raises :class:`~pipeline.errors.ServiceUnavailableError`
(or :class:`~pipeline.errors.ConfigurationError` for a URL libpq cannot parse) whose
message names the server without its password, through the one seam that words driver
errors, :mod:`pipeline.driver_errors`; its wording helpers are re-exported here for the
processes that report connection trouble while they retry.

Every connection made here bounds its waits (:func:`session_parameters`): a
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
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import Engine, create_engine

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
    "connect",
    "describe_server",
    "driver_reason",
    "make_engine",
    "permission_denied",
    "schema_missing_message",
    "session_parameters",
]


def session_parameters(settings: Settings, *, timeouts: bool = True) -> dict[str, Any]:
    """libpq connection parameters that bound a session's waits (see the module docstring).

    The server settings travel in the startup packet (``options``), appended to any the
    URL already carries, so they cost no round trip and hold for the whole session.
    ``timeouts=False`` (schema migrations, which may rightly wait for their locks and run
    long) keeps only the keepalives.
    """
    server: dict[str, int] = {}
    if timeouts:
        server["lock_timeout"] = settings.lock_timeout_ms
        server["statement_timeout"] = settings.statement_timeout_ms
        server["idle_in_transaction_session_timeout"] = settings.idle_in_transaction_timeout_ms
    params: dict[str, Any] = {}
    idle = settings.tcp_keepalives_idle_seconds
    if idle:
        interval = max(1, idle // 2)
        server.update(
            tcp_keepalives_idle=idle, tcp_keepalives_interval=interval, tcp_keepalives_count=3
        )
        params.update(
            keepalives=1, keepalives_idle=idle, keepalives_interval=interval, keepalives_count=3
        )
    existing = conninfo_to_dict(settings.require_database_url()).get("options") or ""
    options = " ".join(f"-c {name}={value}" for name, value in server.items())
    if options:
        params["options"] = f"{existing} {options}".strip()
    return params


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
        params = session_parameters(settings, timeouts=timeouts) | kwargs
        return psycopg.connect(
            url, autocommit=autocommit, connect_timeout=connect_timeout, **params
        )


def make_engine(settings: Settings, *, timeouts: bool = True, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine on psycopg 3 for the configured database, its waits bounded.

    ``hide_parameters``: SQLAlchemy's errors otherwise quote the statement's parameters —
    event payloads — and those errors reach logs (a worker whose connection died).
    """
    return create_engine(
        settings.sqlalchemy_url(),
        connect_args={"connect_timeout": 10, **session_parameters(settings, timeouts=timeouts)},
        hide_parameters=True,
        **kwargs,
    )
