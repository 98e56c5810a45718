"""Where a demo run lives: which servers, schemas and Redis namespace, and what it owns.

Without ``PIPELINE_DATABASE_URL`` / ``PIPELINE_REDIS_URL`` the demo starts throwaway
embedded servers (the ``embedded`` extra) and owns everything on them. Against
configured servers it makes schemas and a key namespace of its own, named after the
run, and drops only those (``--external``: it uses what the running relay and workers
use, and owns nothing).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from pipeline.config import Settings, load_settings
from pipeline.driver_errors import driver_reason
from pipeline.errors import DemoError, EmbeddedServerError
from pipeline.redaction import redact_url
from pipeline.tools.demo.sql import DemoQueries
from pipeline.tools.demo.workload import SKUS, STOCK_PER_SKU
from pipeline.tools.harness.cleanup import Cleanup
from pipeline.transport.namespace import delete_namespace

APP_MODULE = "pipeline.tools.demo.app"
SERVER_STOP_SECONDS = 2.0  # throwaway servers: a clean stop is a courtesy, not a need


@dataclass
class Layout:
    """Where this run lives: servers, schemas, Redis namespace, and what it owns."""

    settings: Settings
    app_schema: str
    own_schemas: bool
    own_namespace: bool
    setup: dict[str, str]


def plan_layout(
    run_id: str,
    external: bool,
    cleanup: Cleanup,
    say: Callable[[str], None],
) -> Layout:
    """Settings for this run; starts throwaway servers where none are configured."""
    base = load_settings()
    database_url = base.database_url.get_secret_value() if base.database_url else None
    redis_url = base.redis_url.get_secret_value() if base.redis_url else None
    if external and (database_url is None or redis_url is None):
        raise DemoError(
            "--external needs PIPELINE_DATABASE_URL and PIPELINE_REDIS_URL "
            "(the servers the running relay and workers use)"
        )
    setup: dict[str, str] = {}
    embedded_pg = database_url is None
    embedded_redis = redis_url is None
    from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis

    if redis_url is None:
        redis_server = EmbeddedRedis(stop_timeout=SERVER_STOP_SECONDS)
        cleanup.push(
            "stop Redis",
            lambda: redis_server.cleanup(cleanup.remaining(SERVER_STOP_SECONDS)),
        )
        say("starting a throwaway Redis (deleted at exit)")
        start_embedded(redis_server, "Redis", "PIPELINE_REDIS_URL")
        redis_url = redis_server.url
        setup["redis"] = f"embedded, throwaway ({redis_url})"
    else:
        variable = "PIPELINE_BROKER_URL" if base.broker_is_amqp else "PIPELINE_REDIS_URL"
        setup["redis"] = f"{variable} {redact_url(redis_url)}"
    if database_url is None:
        postgres = EmbeddedPostgres(durable=False, stop_timeout=SERVER_STOP_SECONDS)
        cleanup.push(
            "stop Postgres",
            lambda: postgres.cleanup(cleanup.remaining(SERVER_STOP_SECONDS)),
        )
        say(
            "starting a throwaway Postgres (durable=False: fsync off, which is fine for a "
            "demo whose data is deleted at exit)"
        )
        start_embedded(postgres, "Postgres", "PIPELINE_DATABASE_URL")
        database_url = postgres.url
        setup["postgres"] = f"embedded, throwaway, durable=False ({database_url})"
    else:
        setup["postgres"] = f"PIPELINE_DATABASE_URL {redact_url(database_url)}"
    own = f"pipeline_demo_{run_id}"
    own_schemas = not embedded_pg and not external
    own_namespace = not embedded_redis and not external
    schema = own if own_schemas else base.schema_name
    app_schema = f"{own}_app" if own_schemas else "pipeline_demo"
    if external:
        app_schema = os.environ.get("PIPELINE_DEMO_SCHEMA", app_schema)
    namespace = own if own_namespace else base.redis_namespace
    settings = base.replace(
        database_url=database_url,
        redis_url=redis_url,
        schema_name=schema,
        redis_namespace=namespace,
        app_modules=APP_MODULE,
        # Messages are authenticated as in production: a key of this run's own unless one
        # is configured (relay, workers and the duplicate injector all sign or verify).
        message_key=base.message_key or secrets.token_urlsafe(32),
    )
    setup["schemas"] = f"{schema} (pipeline), {app_schema} (orders, payments, stock, ...)"
    setup["redis keys"] = (
        f"{namespace}.* (RabbitMQ quorum queues)" if settings.broker_is_amqp else f"{namespace}:*"
    )
    return Layout(settings, app_schema, own_schemas, own_namespace, setup)


def start_embedded(server: Any, name: str, variable: str) -> None:
    try:
        server.start()
    except EmbeddedServerError as exc:
        raise DemoError(
            f"cannot start a throwaway {name}: {str(exc).splitlines()[0]} "
            f"(install the extra: pip install 'outbox-pipeline[embedded]', or set {variable})"
        ) from None


def prepare_database(
    engine: Engine,
    queries: DemoQueries,
    layout: Layout,
    keep_data: bool,
    cleanup: Cleanup,
    notes: list[str],
) -> None:
    """Migrations, then the demo's business tables and stock; registers their removal."""
    from pipeline.db.migrate import upgrade

    settings = layout.settings
    schemas = [settings.schema_name, layout.app_schema]
    try:
        with engine.begin() as connection:
            if layout.own_schemas:
                for schema in schemas:
                    connection.exec_driver_sql(queries.text("create_schema", app=schema))
            upgrade(connection, settings.schema_name)
            connection.exec_driver_sql(queries.text("create_tables"))
            connection.exec_driver_sql(
                queries.text("seed_stock"), {"skus": SKUS, "available": STOCK_PER_SKU}
            )
    except DBAPIError as exc:
        if isinstance(exc, OperationalError):
            raise  # cannot connect: wrap_driver_errors says so in one line
        if isinstance(exc.orig, psycopg.errors.DuplicateSchema):
            raise DemoError(f"schema {schemas} already exists; run the demo again") from None
        cause = exc.orig or exc
        raise DemoError(
            f"cannot prepare the database: {type(cause).__name__}: {driver_reason(cause)}"
        ) from None
    if layout.own_schemas:
        notes.append(
            f"the demo's schemas {', '.join(schemas)} are "
            + ("kept (--keep-data)" if keep_data else "dropped at exit")
        )
        if not keep_data:
            cleanup.push("drop the demo's schemas", lambda: drop_schemas(engine, queries, schemas))
    if layout.own_namespace and not keep_data:
        # RabbitMQ's queues are deleted through its management API: the one configured, if
        # any, else the broker host's default port.
        management = settings.broker_management_url
        cleanup.push(
            "delete the demo's queues"
            if settings.broker_is_amqp
            else "delete the demo's Redis keys",
            lambda: delete_namespace(
                settings.require_redis_url(),
                settings.redis_namespace,
                management.get_secret_value() if management is not None else None,
            ),
        )


def drop_schemas(engine: Engine, queries: DemoQueries, schemas: list[str]) -> None:
    with engine.begin() as connection:
        for schema in schemas:
            connection.exec_driver_sql(queries.text("drop_schema", app=schema))
