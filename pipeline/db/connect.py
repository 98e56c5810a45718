"""Connections and engines built from settings, with driver errors made readable.

Connection failures become :class:`ServiceUnavailableError` whose message names
the server without its password, so the CLI can print one safe line; a role that
lacks a grant gets :class:`PermissionDeniedError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import OperationalError as SAOperationalError

from pipeline.config import Settings, redact_secrets, redact_url
from pipeline.errors import (
    ConfigurationError,
    MigrationError,
    PermissionDeniedError,
    ServiceUnavailableError,
)


def describe_server(url: str) -> str:
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return redact_url(url)
    host = info.get("host") or "localhost"
    return f"{host}:{info.get('port') or 5432}/{info.get('dbname') or ''}"


def permission_denied(exc: BaseException, hint: str = "") -> PermissionDeniedError | None:
    """The driver's "permission denied" (psycopg's, or wrapped by SQLAlchemy) as one line.

    ``None`` for any other error. Postgres names the table or schema; ``hint`` may say
    which grant the operation needed.
    """
    original = getattr(exc, "orig", None) or exc
    if not isinstance(original, psycopg.errors.InsufficientPrivilege):
        return None
    message = str(original).strip().splitlines()[0] if str(original).strip() else "denied"
    return PermissionDeniedError(
        f"{message}: {hint or 'the database role lacks a grant'} (see docs/security.md)"
    )


def driver_reason(exc: BaseException, url: str | None = None) -> str:
    """The driver's message as one line: its own lines joined, hints and the password left out.

    libpq indents its hints ("\tIs the server running…") under the line that matters
    ("connection to server at "h", port 5432 failed: Connection refused"); those indented
    lines, psycopg's "connection failed: " prefix and doubled spaces are dropped.
    """
    lines = [
        " ".join(line.split())
        for line in str(exc).splitlines()
        if line.strip() and not line[:1].isspace()
    ]
    text = "; ".join(lines).removeprefix("connection failed: ") or type(exc).__name__
    password = _password(url) if url else None
    text = text.replace(password, "***") if password else text
    return redact_secrets(text, url) if url else text


def _password(url: str) -> str | None:
    try:
        password = psycopg.conninfo.conninfo_to_dict(url).get("password")
        return str(password) if password else None
    except psycopg.ProgrammingError:
        return None


def connect(
    settings: Settings, *, autocommit: bool = False, connect_timeout: int = 10, **kwargs: Any
) -> psycopg.Connection[Any]:
    """A psycopg connection to the configured database."""
    url = settings.require_database_url()
    try:
        return psycopg.connect(
            url, autocommit=autocommit, connect_timeout=connect_timeout, **kwargs
        )
    except psycopg.OperationalError as exc:
        raise ServiceUnavailableError(
            f"cannot connect to Postgres at {describe_server(url)}: {driver_reason(exc, url)}"
        ) from None
    except psycopg.ProgrammingError as exc:  # a URL libpq cannot parse
        raise ConfigurationError(
            f"PIPELINE_DATABASE_URL: not a valid Postgres URL ({driver_reason(exc, url)})"
        ) from None


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


@contextmanager
def readable_database_errors(settings: Settings) -> Iterator[None]:
    """Turn SQLAlchemy connection failures into one-line :class:`ServiceUnavailableError`."""
    try:
        yield
    except SAOperationalError as exc:
        url = settings.require_database_url()
        raise ServiceUnavailableError(
            f"cannot use Postgres at {describe_server(url)}: {driver_reason(exc.orig or exc, url)}"
        ) from None


SCHEMA_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)


def schema_missing_message(schema: str) -> str:
    return f"the pipeline schema {schema!r} is not installed: run `pipeline db upgrade`"


@contextmanager
def readable_psycopg_errors(settings: Settings) -> Iterator[None]:
    """One-shot commands: a lost server or a missing schema becomes one clear error line."""
    try:
        yield
    except SCHEMA_MISSING:
        raise MigrationError(schema_missing_message(settings.schema_name)) from None
    except psycopg.OperationalError as exc:
        url = settings.require_database_url()
        raise ServiceUnavailableError(
            f"cannot use Postgres at {describe_server(url)}: {driver_reason(exc, url)}"
        ) from None
