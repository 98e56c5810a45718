"""Connections and engines built from settings.

A connection that cannot be opened raises :class:`~pipeline.errors.ServiceUnavailableError`
(or :class:`~pipeline.errors.ConfigurationError` for a URL libpq cannot parse) whose
message names the server without its password, through the one seam that words driver
errors, :mod:`pipeline.driver_errors`; its wording helpers are re-exported here for the
processes that report connection trouble while they retry.
"""

from __future__ import annotations

from typing import Any

import psycopg
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
]


def connect(
    settings: Settings, *, autocommit: bool = False, connect_timeout: int = 10, **kwargs: Any
) -> psycopg.Connection[Any]:
    """A psycopg connection to the configured database."""
    url = settings.require_database_url()
    with wrap_driver_errors(settings, "connect to"):
        return psycopg.connect(
            url, autocommit=autocommit, connect_timeout=connect_timeout, **kwargs
        )


def make_engine(settings: Settings, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine on psycopg 3 for the configured database.

    ``hide_parameters``: SQLAlchemy's errors otherwise quote the statement's parameters —
    event payloads — and those errors reach logs (a worker whose connection died).
    """
    return create_engine(
        settings.sqlalchemy_url(),
        connect_args={"connect_timeout": 10},
        hide_parameters=True,
        **kwargs,
    )
