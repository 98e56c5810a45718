"""The one seam where driver errors become :class:`~pipeline.errors.PipelineError`.

The pipeline's own commands (the CLI, ``pipeline status``, migrations, ``connect``,
the demo) run their server calls inside :func:`wrap_driver_errors`, which turns a
driver's failure into one line an operator can act on, naming the server without
its password:

* psycopg's ``OperationalError``, also inside SQLAlchemy's wrapper, becomes
  :class:`~pipeline.errors.ServiceUnavailableError` ("cannot connect to Postgres at
  host:port/db: Connection refused");
* "permission denied" becomes :class:`~pipeline.errors.PermissionDeniedError`;
* a missing table or schema of the pipeline's own schema becomes
  :class:`~pipeline.errors.MigrationError` ("... run `pipeline db upgrade`");
* a Postgres URL libpq cannot parse, while connecting, becomes
  :class:`~pipeline.errors.ConfigurationError`;
* any redis-py error becomes :class:`~pipeline.errors.ServiceUnavailableError`.

Other exceptions pass through untouched: they are bugs and keep their traceback. The
relay's and the inbox's loops handle driver errors themselves (they wait and retry);
they use this module's wording (:func:`describe_server`, :func:`driver_reason`,
:func:`schema_missing_message`) so that every message reads the same.

SQLAlchemy and redis-py are only consulted if they are imported: an error of a driver
never loaded cannot be in flight, and ``pipeline trace`` or ``status`` stay free of
SQLAlchemy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from pipeline.config import Settings
from pipeline.errors import (
    ConfigurationError,
    MigrationError,
    PermissionDeniedError,
    PipelineError,
    ServiceUnavailableError,
)
from pipeline.redaction import mask_secret, redact_secrets, redact_url

SCHEMA_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)


@contextmanager
def wrap_driver_errors(settings: Settings, verb: str = "use") -> Iterator[None]:
    """Run the block; driver failures leave it as one-line :class:`PipelineError`.

    ``verb`` completes "cannot <verb> Postgres at ...": "connect to" where the block
    opens a connection, "use" where it runs statements. Works as a decorator too.
    """
    try:
        yield
    except PipelineError:
        raise
    except Exception as exc:
        translated = translate(exc, settings, verb)
        if translated is None:
            raise
        raise translated from None


def translate(exc: BaseException, settings: Settings, verb: str = "use") -> PipelineError | None:
    """The :class:`PipelineError` a driver error stands for, or None if it is not one."""
    cause = _unwrap_sqlalchemy(exc)
    if isinstance(cause, psycopg.Error):
        return _postgres_error(cause, settings, verb)
    redis = sys.modules.get("redis")
    if redis is not None and isinstance(cause, redis.RedisError):
        url = settings.require_redis_url() if settings.redis_url else ""
        where = redact_url(url) if url else "Redis"
        reason = redact_secrets(str(cause), url) if url else str(cause)
        return ServiceUnavailableError(
            f"cannot {verb} Redis at {where}: {type(cause).__name__}: {reason}"
        )
    return None


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is a server being out of reach, not a bug: Postgres refusing or
    dropping connections (``OperationalError``, a connection SQLAlchemy invalidated, its
    pool timing out), or Redis unreachable. Processes wait and retry these, in one line."""
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is not None:
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            return True
        if isinstance(exc, sa_exc.TimeoutError):
            return True
    cause = _unwrap_sqlalchemy(exc)
    if isinstance(cause, (psycopg.OperationalError, psycopg.InterfaceError)):
        return True
    redis = sys.modules.get("redis")
    return redis is not None and isinstance(cause, (redis.ConnectionError, redis.TimeoutError))


def _unwrap_sqlalchemy(exc: BaseException) -> BaseException:
    """SQLAlchemy's ``DBAPIError`` carries the driver's own error in ``orig``."""
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is not None and isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
        orig: BaseException = exc.orig
        return orig
    return exc


def _postgres_error(exc: psycopg.Error, settings: Settings, verb: str) -> PipelineError | None:
    url = settings.require_database_url()
    if isinstance(exc, psycopg.OperationalError):
        return ServiceUnavailableError(
            f"cannot {verb} Postgres at {describe_server(url)}: {driver_reason(exc, url)}"
        )
    denied = permission_denied(exc)
    if denied is not None:
        return denied
    schema = settings.schema_name
    if isinstance(exc, SCHEMA_MISSING) and (f'"{schema}.' in str(exc) or f'"{schema}"' in str(exc)):
        return MigrationError(schema_missing_message(schema))
    if verb == "connect to" and isinstance(exc, psycopg.ProgrammingError) and not exc.sqlstate:
        return ConfigurationError(  # raised by libpq before any server answered
            f"PIPELINE_DATABASE_URL: not a valid Postgres URL ({driver_reason(exc, url)})"
        )
    return None


def describe_server(url: str) -> str:
    """``host:port/dbname`` of a Postgres URL: enough to tell servers apart, no secrets."""
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
    original = _unwrap_sqlalchemy(exc)
    if not isinstance(original, psycopg.errors.InsufficientPrivilege):
        return None
    message = str(original).strip().splitlines()[0] if str(original).strip() else "denied"
    return PermissionDeniedError(
        f"{message}: {hint or 'the database role lacks a grant'} (see docs/security.md)"
    )


def driver_reason(exc: BaseException, url: str | None = None) -> str:
    """The driver's message as one line: its own lines joined, hints and the password left out.

    libpq indents its hints ("\\tIs the server running…") under the line that matters
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
    text = mask_secret(text, password) if password else text
    return redact_secrets(text, url) if url else text


def _password(url: str) -> str | None:
    try:
        password = psycopg.conninfo.conninfo_to_dict(url).get("password")
        return str(password) if password else None
    except psycopg.ProgrammingError:
        return None


def schema_missing_message(schema: str) -> str:
    return f"the pipeline schema {schema!r} is not installed: run `pipeline db upgrade`"


__all__ = [
    "SCHEMA_MISSING",
    "describe_server",
    "driver_reason",
    "is_outage",
    "permission_denied",
    "schema_missing_message",
    "translate",
    "wrap_driver_errors",
]
