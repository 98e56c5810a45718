"""Versioned schema migrations, safe to run from many processes at once.

Migrations are the numbered ``migrations/NNNN_name.sql`` files, applied in order in
one transaction under an advisory lock, so concurrent ``pipeline db upgrade`` runs
queue up and the later ones find nothing to do. ``functions.sql`` holds repeatable
objects (functions, triggers), re-applied only when its checksum changes.

Applications with their own Alembic history can call :func:`upgrade` from an
Alembic migration with ``op.get_bind()`` (see docs/operations.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from psycopg import sql
from sqlalchemy import Connection, text

from pipeline.config import MAX_PAYLOAD_CEILING, validate_identifier
from pipeline.db.ordering import ORDERING_LOCK_BUCKETS, ORDERING_LOCK_CLASS
from pipeline.errors import MigrationError

FUNCTIONS_VERSION = 0  # the version-table row that records functions.sql's checksum


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def _package_sql(name: str) -> str:
    return (resources.files("pipeline.db") / name).read_text(encoding="utf-8")


def available_migrations() -> list[Migration]:
    """The migrations shipped with this version of the package, in order."""
    folder = resources.files("pipeline.db") / "migrations"
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(
                Migration(int(number), rest.removesuffix(".sql"), entry.read_text("utf-8"))
            )
    return sorted(found, key=lambda m: m.version)


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a pipeline schema."""
    return f"{validate_identifier(schema, 'schema name')}_outbox"


def functions_sql(schema: str) -> str:
    """The repeatable functions and triggers for ``schema``, ready to execute."""
    channel = sql.Literal(notify_channel(schema)).as_string()
    return (
        _package_sql("functions.sql")
        .replace(":channel", channel)
        .replace(":ordering_lock_class", str(ORDERING_LOCK_CLASS))
        .replace(":ordering_lock_buckets", str(ORDERING_LOCK_BUCKETS))
        .replace(":payload_limit", str(MAX_PAYLOAD_CEILING))
        .replace(":schema", _quoted(schema))
    )


def functions_checksum(schema: str) -> str:
    """The checksum ``upgrade`` records for :func:`functions_sql` (``pipeline doctor``)."""
    return _checksum(functions_sql(schema))


def _quoted(schema: str) -> str:
    return sql.Identifier(validate_identifier(schema, "schema name")).as_string()


def _statement(template: str, schema: str) -> str:
    """``template`` with ``{}`` replaced by the quoted schema identifier."""
    identifier = sql.Identifier(validate_identifier(schema, "schema name"))
    return sql.SQL(template).format(identifier).as_string()


@dataclass(frozen=True)
class UpgradeResult:
    applied: list[int]
    functions_refreshed: bool

    @property
    def changed(self) -> bool:
        return bool(self.applied) or self.functions_refreshed


def upgrade(connection: Connection, schema: str = "pipeline") -> UpgradeResult:
    """Bring ``schema`` up to date inside the connection's current transaction.

    The caller commits (``engine.begin()`` does); an Alembic migration's bind works too.
    """
    validate_identifier(schema, "schema name")
    connection.execute(
        text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"pipeline.migrate.{schema}"}
    )
    # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema exists:
    # asking first lets a least-privilege owner upgrade a schema it was given (docs/security.md).
    if not connection.execute(
        text("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = :schema)"), {"schema": schema}
    ).scalar_one():
        connection.exec_driver_sql(_statement("CREATE SCHEMA {}", schema))
    connection.exec_driver_sql(_statement("SET LOCAL search_path TO {}", schema))
    connection.exec_driver_sql(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    rows = connection.execute(text("SELECT version, checksum FROM schema_migrations")).all()
    recorded = {int(version): str(checksum) for version, checksum in rows}
    shipped = available_migrations()
    newest = max((m.version for m in shipped), default=0)
    unknown = sorted(v for v in recorded if v > newest)
    if unknown:
        raise MigrationError(
            f"schema {schema!r} has migration {unknown[-1]}, newer than this code knows "
            f"(latest {newest}); upgrade the pipeline package"
        )
    applied = []
    for migration in shipped:
        if migration.version in recorded:
            continue
        connection.exec_driver_sql(migration.sql)
        _record(connection, migration.version, migration.name, _checksum(migration.sql))
        applied.append(migration.version)
    functions = functions_sql(schema)
    refreshed = recorded.get(FUNCTIONS_VERSION) != _checksum(functions)
    if refreshed:
        connection.exec_driver_sql(functions)
        connection.execute(
            text("DELETE FROM schema_migrations WHERE version = :v"), {"v": FUNCTIONS_VERSION}
        )
        _record(connection, FUNCTIONS_VERSION, "functions", _checksum(functions))
    connection.exec_driver_sql("SET LOCAL search_path TO DEFAULT")
    return UpgradeResult(applied, refreshed)


def pending_migrations(connection: Connection, schema: str = "pipeline") -> list[int]:
    """Versions not yet applied (all of them when the schema does not exist)."""
    exists = connection.execute(
        text("SELECT to_regclass(:t) IS NOT NULL"), {"t": f"{_quoted(schema)}.schema_migrations"}
    ).scalar_one()
    done: set[int] = set()
    if exists:
        query = _statement("SELECT version FROM {}.schema_migrations", schema)
        done = set(connection.exec_driver_sql(query).scalars())
    return [m.version for m in available_migrations() if m.version not in done]


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def _record(connection: Connection, version: int, name: str, checksum: str) -> None:
    connection.execute(
        text("INSERT INTO schema_migrations (version, name, checksum) VALUES (:v, :n, :c)"),
        {"v": version, "n": name, "c": checksum},
    )
