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
from pipeline.errors import PermissionDeniedError, ServiceUnavailableError


def _describe(url: str) -> str:
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return redact_url(url)
    host = info.get("host") or "localhost"
    return f"{host}:{info.get('port') or 5432}/{info.get('dbname') or ''}"


def _first_line(exc: BaseException, url: str = "") -> str:
    text = str(exc).strip().splitlines()
    line = text[-1] if text else type(exc).__name__
    return redact_secrets(line, url) if url else line


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


def connect(
    settings: Settings, *, autocommit: bool = False, **kwargs: Any
) -> psycopg.Connection[Any]:
    """A psycopg connection to the configured database."""
    url = settings.require_database_url()
    try:
        return psycopg.connect(url, autocommit=autocommit, connect_timeout=10, **kwargs)
    except psycopg.OperationalError as exc:
        raise ServiceUnavailableError(
            f"cannot connect to Postgres at {_describe(url)}: {_first_line(exc, url)}"
        ) from None


def make_engine(settings: Settings, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine on psycopg 3 for the configured database."""
    return create_engine(settings.sqlalchemy_url(), connect_args={"connect_timeout": 10}, **kwargs)


@contextmanager
def readable_database_errors(settings: Settings) -> Iterator[None]:
    """Turn SQLAlchemy connection failures into one-line :class:`ServiceUnavailableError`."""
    try:
        yield
    except SAOperationalError as exc:
        url = settings.require_database_url()
        raise ServiceUnavailableError(
            f"cannot use Postgres at {_describe(url)}: {_first_line(exc.orig or exc, url)}"
        ) from None
