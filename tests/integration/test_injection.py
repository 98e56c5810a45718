"""Hostile input through every identifier and value the settings, CLI and API accept.

Names that end up in SQL or Redis keys (schema, namespace, consumer, queue) are
refused with one clear error; values (aggregate fields, ordering keys, headers,
payloads) are data, stored verbatim. Every test ends by checking that the outbox
is still there and that no statement ran.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from pipeline import (
    ConfigurationError,
    EventValidationError,
    NewEvent,
    Settings,
    add_event,
    add_events,
    configure,
    consumer,
    load_settings,
)
from pipeline.db.migrate import functions_sql, notify_channel, upgrade
from pipeline.db.queries import queries_for
from pipeline.db.stores.state import StateStore
from pipeline.registry import Registry
from pipeline.tools.cli import main as cli_main
from pipeline.tools.ops.lineage import load_lineage
from tests.conftest import create_database, drop_database

HOSTILE = {
    "statement": "x; DROP TABLE outbox; --",
    "quote": "x'; DROP TABLE pipeline.outbox; --",
    "double-quote": 'pipeline"; DROP TABLE "pipeline".outbox; --',
    "paren": "Robert'); DROP TABLE outbox;--",
    "tautology": "' OR '1'='1",
    "dollar": "$$; DROP TABLE outbox; $$",
    "backslash": "\\'; DROP TABLE outbox; --",
    "comment": "pipeline/**/;DROP/**/TABLE/**/outbox",
    "newline": "pipeline\n",
    "upper": "Pipeline",
    "unicode": "ünïcödé_名前",
    "emoji": "😀",
    "space": "a b",
    "digit": "1abc",
    "empty": "",
    "long": "a" * 10_000,
    "nul": "x\x00y",
    "surrogate": "x\ud800y",
}
VALUES = list(HOSTILE.values())
IDS = list(HOSTILE)
IN_ENVIRONMENT = {k: v for k, v in HOSTILE.items() if "\x00" not in v and "\ud800" not in v}
# The only hostile values that are legitimate names: the rest are refused everywhere.
VALID_QUEUES = {"Pipeline"}
VALID_EVENT_TYPES = {"Pipeline", "1abc"}
MODULE_NAMES = {k: v for k, v in IN_ENVIRONMENT.items() if v.strip() not in ("", "pipeline")}
BAD_QUEUES = {k: v for k, v in IN_ENVIRONMENT.items() if v not in VALID_QUEUES}
BAD_EVENT_TYPES = {k: v for k, v in HOSTILE.items() if v not in VALID_EVENT_TYPES}


@pytest.fixture(scope="module")
def module_settings(
    postgres_server_url: str, template_database: str, redis_server_url: str
) -> Iterator[Settings]:
    """One migrated database for the module: hostile input must leave it as it was."""
    name, url = create_database(postgres_server_url, template_database)
    try:
        yield Settings(
            database_url=url,  # type: ignore[arg-type]
            redis_url=redis_server_url,  # type: ignore[arg-type]
            redis_namespace=f"injection{uuid.uuid4().hex[:8]}",
            canary_interval=0,
        )
    finally:
        drop_database(postgres_server_url, name)


@pytest.fixture(scope="module")
def module_engine(module_settings: Settings) -> Iterator[Engine]:
    engine = create_engine(module_settings.sqlalchemy_url())
    yield engine
    engine.dispose()


@pytest.fixture
def settings(module_settings: Settings) -> Iterator[Settings]:
    configure(module_settings)
    yield module_settings
    configure(None)


@pytest.fixture
def guarded(settings: Settings, module_engine: Engine) -> Iterator[Engine]:
    """The module's database, checked after each test: the outbox exists, nothing was lost."""
    before = _outbox_count(module_engine)
    yield module_engine
    with module_engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass('pipeline.outbox')")).scalar() is not None
        assert conn.execute(text("SELECT to_regclass('outbox')")).scalar() is None
    assert _outbox_count(module_engine) >= before


def _outbox_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM pipeline.outbox")).scalar_one())


def run_cli(args: list[str], monkeypatch, capsys, **env: str) -> tuple[int, str, str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        cli_main(args)
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out, captured.err


def cli_env(settings: Settings) -> dict[str, str]:
    return {
        "PIPELINE_DATABASE_URL": settings.require_database_url(),
        "PIPELINE_REDIS_URL": settings.require_redis_url(),
        "PIPELINE_REDIS_NAMESPACE": settings.redis_namespace,
    }


# -- names that become SQL identifiers or Redis keys --------------------------------------------


@pytest.mark.parametrize("variable", ["PIPELINE_SCHEMA_NAME", "PIPELINE_REDIS_NAMESPACE"])
@pytest.mark.parametrize("value", list(IN_ENVIRONMENT.values()), ids=list(IN_ENVIRONMENT))
@pytest.mark.parametrize("command", [["status"], ["db", "upgrade"], ["trace", str(uuid.uuid4())]])
def test_a_hostile_setting_is_refused_in_one_line(
    guarded, settings, variable, value, command, monkeypatch, capsys
):
    env = {**cli_env(settings), variable: value}
    code, out, err = run_cli(command, monkeypatch, capsys, **env)
    assert (code, out) == (1, "")
    (line,) = err.splitlines()
    assert line.startswith(f"pipeline: error: {variable}: "), line
    assert "use 1-63 characters of a-z, 0-9 and _" in line
    assert repr(value) not in line and (len(value) < 20 or value not in line)  # not echoed


@pytest.mark.parametrize("value", VALUES, ids=IDS)
def test_a_hostile_schema_name_never_reaches_sql(guarded, settings, value):
    with pytest.raises(ConfigurationError, match="PIPELINE_SCHEMA_NAME"):
        load_settings(database_url=settings.require_database_url(), schema_name=value)
    message = "invalid schema name"
    for call in (
        lambda: queries_for(value),
        lambda: notify_channel(value),
        lambda: functions_sql(value),
    ):
        with pytest.raises(ConfigurationError, match=message):
            call()
    with psycopg.connect(settings.require_database_url(), autocommit=True) as conn:
        with pytest.raises(ConfigurationError, match=message):
            load_lineage(conn, value, uuid.uuid4())
        with pytest.raises(ConfigurationError, match=message):
            StateStore(value).snapshot(conn, 60.0)
    with guarded.begin() as conn:
        with pytest.raises(ConfigurationError, match=message):
            upgrade(conn, value)
        schemas = conn.execute(text("SELECT count(*) FROM pg_namespace")).scalar_one()
    with guarded.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pg_namespace")).scalar_one() == schemas


@pytest.mark.parametrize("value", VALUES, ids=IDS)
def test_a_hostile_consumer_queue_or_subscribed_type_is_refused(guarded, value):
    routes = Registry()
    with pytest.raises(ConfigurationError, match="invalid consumer name"):
        routes.subscribe(value, ["order.placed"])
    with pytest.raises(ConfigurationError, match="invalid consumer name"):
        consumer(value, ["order.placed"], registry=routes)(lambda event, ctx: None)
    if value in VALID_QUEUES:
        assert routes.subscribe("shipping", ["order.placed"], queue=value).queue == value
    else:
        with pytest.raises(ConfigurationError, match="invalid queue name"):
            routes.subscribe("billing", ["order.placed"], queue=value)
    if value in VALID_EVENT_TYPES:  # a name, kept verbatim for routing
        assert routes.subscribe("audit", [value]).event_types == {value}
    else:
        with pytest.raises(ConfigurationError, match="invalid event type"):
            routes.subscribe("billing", [value])
    assert "billing" not in {s.consumer for s in routes.all()}


@pytest.mark.parametrize("value", list(BAD_QUEUES.values()), ids=list(BAD_QUEUES))
def test_a_hostile_worker_queue_is_refused_in_one_line(
    guarded, settings, value, monkeypatch, capsys
):
    code, out, err = run_cli(
        ["worker", "--queues", value], monkeypatch, capsys, **cli_env(settings)
    )
    assert (code, out) == (1, "")
    (line,) = err.splitlines()
    assert line.startswith("pipeline: error: invalid queue name"), line


@pytest.mark.parametrize("value", list(MODULE_NAMES.values()), ids=list(MODULE_NAMES))
def test_a_hostile_app_module_is_refused_in_one_line(guarded, settings, value, monkeypatch, capsys):
    code, out, err = run_cli(["status", "--app", value], monkeypatch, capsys, **cli_env(settings))
    assert (code, out) == (1, "")
    (line,) = err.splitlines()
    assert line.startswith("pipeline: error: ") and "PIPELINE_APP_MODULES" in line, line
    assert "is not a module name" in line or "cannot import" in line, line


# -- operator arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("value", list(IN_ENVIRONMENT.values()), ids=list(IN_ENVIRONMENT))
def test_a_hostile_event_id_is_a_usage_error(guarded, settings, value, monkeypatch, capsys):
    code, out, err = run_cli(["trace", value], monkeypatch, capsys, **cli_env(settings))
    assert (code, out) == (2, "")
    assert "is not an event id (a UUID)" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "value",
    [*IN_ENVIRONMENT.values(), "nan", "-1", "1e400x"],
    ids=[*IN_ENVIRONMENT, "nan", "-1", "junk"],
)
@pytest.mark.parametrize("option", ["--max-pending-age", "--max-dead-letters"])
def test_a_hostile_status_threshold_is_a_usage_error(
    guarded, settings, option, value, monkeypatch, capsys
):
    code, out, err = run_cli(["status", option, value], monkeypatch, capsys, **cli_env(settings))
    assert (code, out) == (2, ""), err
    assert f"Invalid value for '{option}'" in err and "Traceback" not in err


# -- values: data, stored verbatim --------------------------------------------------------------


def _storable(value: str, limit: int) -> bool:
    return 0 < len(value) <= limit and "\x00" not in value and "\ud800" not in value


@pytest.mark.parametrize("value", list(BAD_EVENT_TYPES.values()), ids=list(BAD_EVENT_TYPES))
def test_a_hostile_event_type_is_refused_and_the_transaction_goes_on(guarded, value):
    before = _outbox_count(guarded)
    with Session(guarded) as session, session.begin():
        with pytest.raises(EventValidationError, match="event_type must be 1-200 characters"):
            add_event(session, value, {"n": 1})
        event_id = add_event(session, "order.placed", {"n": 2})  # the transaction is usable
    with guarded.connect() as conn:
        stored = conn.execute(
            text("SELECT event_type FROM pipeline.outbox WHERE id = :id"), {"id": event_id}
        ).scalar_one()
    assert stored == "order.placed" and _outbox_count(guarded) == before + 1


@pytest.mark.parametrize("value", VALUES, ids=IDS)
def test_hostile_values_are_stored_verbatim_or_refused_before_any_sql(guarded, value):
    fields = {"aggregate_type": value, "aggregate_id": value, "ordering_key": value}
    with Session(guarded) as session, session.begin():
        if _storable(value, 500):
            event_id = add_event(session, "order.placed", {"v": value}, **fields)
        else:
            with pytest.raises(EventValidationError, match="aggregate_type"):
                add_event(session, "order.placed", {"v": "x"}, **fields)
            event_id = None
        if _storable(value, 1024) or value == "":
            header_id = add_event(session, "order.placed", {"v": value}, headers={"h": value})
        else:
            with pytest.raises(EventValidationError, match="header 'h'"):
                add_event(session, "order.placed", {"v": "x"}, headers={"h": value})
            header_id = None
        if "\ud800" in value:
            with pytest.raises(EventValidationError, match="lone surrogate"):
                add_event(session, "order.placed", {"v": value})
            payload_id = None
        elif "\x00" in value:
            with pytest.raises(EventValidationError, match="NUL"):
                add_event(session, "order.placed", {"v": value})
            payload_id = None
        else:
            payload_id = add_events(session, [NewEvent("order.placed", {value: value})])[0]
    written = [i for i in (event_id, header_id, payload_id) if i is not None]
    with guarded.connect() as conn:
        rows = {
            row.id: row
            for row in conn.execute(
                text(
                    "SELECT id, aggregate_type, aggregate_id, ordering_key, payload::text, "
                    "headers ->> 'h' AS header FROM pipeline.outbox WHERE id = ANY(:ids)"
                ),
                {"ids": written},
            )
        }
    assert set(rows) == set(written)
    if event_id is not None:
        row = rows[event_id]
        assert (row.aggregate_type, row.aggregate_id, row.ordering_key) == (value, value, value)
        assert json.loads(row.payload) == {"v": value}
    if header_id is not None:
        assert rows[header_id].header == value
    if payload_id is not None:
        assert json.loads(rows[payload_id].payload) == {value: value}
