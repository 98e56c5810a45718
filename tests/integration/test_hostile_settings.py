"""Hostile but realistic input: every case ends in one clear line, never a traceback.

Table-driven: each row is a command, the environment it runs in, the exit code and a
piece of the one line it must print on stderr. Commands that end at once run in this
process (:func:`run_cli`); ``pipeline relay`` and ``pipeline worker`` run as real
processes, because the point there is that they exit at start instead of retrying a
setting that can never work (the subprocess timeout fails a process that waits).
"""

from __future__ import annotations

import os
import typing
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text

from pipeline import add_event
from pipeline.config import Settings
from pipeline.transport.namespace import delete_namespace
from tests.conftest import create_database, drop_database
from tests.integration.test_roles import Deployment, deployment  # noqa: F401 - a fixture
from tests.support import ROOT, Ran, run_cli, run_cli_process

BAD_PORT = "is not a valid URL: its port is not a number"


@pytest.fixture(scope="module")
def base_env(
    postgres_server_url: str, template_database: str, redis_server_url: str
) -> Iterator[dict[str, str]]:
    """Working settings (a migrated database, a Redis namespace) that each case spoils once.

    One database for the module: no case writes to it, as every case is refused first.
    """
    name, url = create_database(postgres_server_url, template_database)
    namespace = f"hostile{uuid.uuid4().hex[:8]}"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIPELINE_")}
    env.update(
        PIPELINE_DATABASE_URL=url,
        PIPELINE_REDIS_URL=redis_server_url,
        PIPELINE_REDIS_NAMESPACE=namespace,
        PIPELINE_CANARY_INTERVAL="0",
        PIPELINE_METRICS_PORT="0",
        PIPELINE_WORKER_METRICS_PORT="0",
        PIPELINE_MESSAGE_KEY="insecure",  # authentication is another test's subject
        PYTHONPATH=str(ROOT),
    )
    try:
        yield env
    finally:
        drop_database(postgres_server_url, name)
        delete_namespace(redis_server_url, namespace)


def one_line(result: Ran, code: int, needle: str) -> str:
    """The single line on stderr, after checking the exit code and that no traceback shows."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0], lines[0]
    return lines[0]


def _with_port(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


# (id, argv, variables changed, exit code, in the line). A variable value "{db}?port=x"
# is the working database URL with that query added.
CLI_CASES: list[tuple[str, list[str], dict[str, str], int, str]] = [
    ("db-upgrade-port-x", ["db", "upgrade"], {"PIPELINE_DATABASE_URL": "{db}port=x"}, 1, BAD_PORT),
    ("db-pending-port-x", ["db", "pending"], {"PIPELINE_DATABASE_URL": "{db}port=x"}, 1, BAD_PORT),
    (
        "db-password-with-at",
        ["db", "pending"],
        {"PIPELINE_DATABASE_URL": "postgresql://u:p@ss@127.0.0.1:5432/db"},
        1,
        "PIPELINE_DATABASE_URL: has an @ in its user name or password",
    ),
    *[
        (
            f"{command}-redis-{kind}",
            [command],
            {"PIPELINE_REDIS_URL": url},
            1,
            f"PIPELINE_REDIS_URL: {message}",
        )
        for command in ("status", "doctor")
        for kind, url, message in (
            ("port-x", "redis://127.0.0.1:x/0", BAD_PORT),
            ("bracket", "redis://[::1/0", "is not a valid URL"),
            ("notadb", "redis://127.0.0.1:6379/notadb", "names a database that is not a number"),
            ("db-query", "redis://127.0.0.1:6379?db=x", "names a database that is not a number"),
        )
    ],
    ("lease-inf", ["status"], {"PIPELINE_LEASE_SECONDS": "inf"}, 1, "PIPELINE_LEASE_SECONDS:"),
    ("lease-nan", ["status"], {"PIPELINE_LEASE_SECONDS": "nan"}, 1, "finite number"),
    (
        "batch-size-3e9",
        ["status"],
        {"PIPELINE_BATCH_SIZE": "3000000000"},
        1,
        "PIPELINE_BATCH_SIZE: Input should be less than or equal to 100000",
    ),
    (
        "prune-interval-inf",
        ["prune"],
        {"PIPELINE_PRUNE_INTERVAL_SECONDS": "inf"},
        1,
        "PIPELINE_PRUNE_INTERVAL_SECONDS: Input should be a finite number",
    ),
    *[
        (f"dlq-{command}-{option}", ["dlq", command, option, "99999999999999999999"], {}, 2, option)
        for command, options in (
            ("list", ("--id", "--limit")),
            ("replay", ("--id", "--limit")),
            ("purge", ("--id",)),
            ("audit", ("--limit",)),
        )
        for option in options
    ],
    ("dlq-show-id", ["dlq", "show", "99999999999999999999"], {}, 2, "DEAD_LETTER_ID"),
    *[
        (
            f"dlq-{command}-since",
            ["dlq", command, "--since", "99999999999d", *(["--dry-run"] * (command == "replay"))],
            {},
            2,
            "--since '99999999999d' is longer than 100 years",
        )
        for command in ("list", "replay")
    ],
    (
        "status-interval",
        ["status", "--interval", "99999999999d"],
        {},
        2,
        "'99999999999d' is longer than 100 years",
    ),
    (
        "replay-rate-nan",
        ["dlq", "replay", "--rate", "nan", "--reason", "x"],
        {},
        2,
        "'nan' is not a finite number",
    ),
    (
        "replay-rate-tiny",
        ["dlq", "replay", "--rate", "1e-300", "--reason", "x"],
        {},
        2,
        "'1e-300' is not a pace from 0.001",
    ),
    (
        "consumer-string-types",
        ["status", "--app", "tests.apps.hostile_letters_app"],
        {},
        1,
        "consumer 'hostile_letters': event types must be a list such as ['order'], not a str",
    ),
    (
        "consumer-time-limit-nan",
        ["status", "--app", "tests.apps.hostile_time_limit_app"],
        {},
        1,
        "consumer 'hostile_time_limit': time_limit must be a number of seconds above 0",
    ),
]


def _spoil(env: dict[str, str], changes: dict[str, str]) -> dict[str, str]:
    spoiled = dict(env)
    for name, value in changes.items():
        if value.startswith("{db}"):
            spoiled[name] = _with_port(env["PIPELINE_DATABASE_URL"], value.removeprefix("{db}"))
        else:
            spoiled[name] = value
    return spoiled


@pytest.mark.parametrize(
    ("argv", "changes", "code", "needle"),
    [case[1:] for case in CLI_CASES],
    ids=[case[0] for case in CLI_CASES],
)
def test_a_command_refuses_hostile_input_with_one_line(
    base_env: dict[str, str], argv: list[str], changes: dict[str, str], code: int, needle: str
) -> None:
    line = one_line(run_cli(argv, _spoil(base_env, changes)), code, needle)
    assert line.startswith("pipeline: error: ")


def _numeric_fields() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Settings, include_extras=True)
    fields = []
    for name in Settings.model_fields:
        base = typing.get_args(hints[name])[0] if typing.get_args(hints[name]) else hints[name]
        if base in (int, float):
            fields.append((name, base))
    return fields


NUMERIC = _numeric_fields()
TOO_BIG = {int: "99999999999999999999", float: "1e300"}


@pytest.mark.parametrize(
    ("field", "value"),
    [(name, value) for name, kind in NUMERIC for value in ("nan", "inf", TOO_BIG[kind])],
    ids=[f"{name}={value}" for name, kind in NUMERIC for value in ("nan", "inf", TOO_BIG[kind])],
)
def test_every_numeric_setting_has_both_bounds(
    base_env: dict[str, str], field: str, value: str
) -> None:
    variable = f"PIPELINE_{field.upper()}"
    line = one_line(run_cli(["db", "pending"], {**base_env, variable: value}), 1, f"{variable}: ")
    assert line.startswith("pipeline: error: ")


def test_the_numeric_settings_are_all_covered() -> None:
    """A new numeric setting joins the table above by itself: the list is not hand-kept."""
    names = {name for name, _ in NUMERIC}
    assert {"lease_seconds", "batch_size", "prune_interval_seconds", "backlog_limit"} <= names
    assert len(names) >= 30


@pytest.mark.parametrize(
    ("variable", "suggested"),
    [
        ("PIPELINE_DATABASE_ULR", "PIPELINE_DATABASE_URL"),
        ("PIPELINE_REDELIVERY_HORIZON", "PIPELINE_REDELIVERY_HORIZON_SECONDS"),
        ("PIPELINE_BATCHSIZE", "PIPELINE_BATCH_SIZE"),
        ("PIPELINE_LEASE_SECOND", "PIPELINE_LEASE_SECONDS"),
    ],
)
def test_an_unknown_variable_is_named_with_the_closest_setting(
    base_env: dict[str, str], variable: str, suggested: str
) -> None:
    result = run_cli(["db", "pending"], {**base_env, variable: "5"})
    line = one_line(result, 0, f"unknown variable {variable} (did you mean {suggested}?)")
    assert line.startswith("pipeline: warning: ")
    assert line.endswith("no setting has that name, so it changes nothing")


# -- relay and worker: real processes that must exit at start ----------------------------------

PROCESS_CASES: list[tuple[str, str, dict[str, str], str]] = [
    *[
        (f"{command}-{kind}", command, changes, needle)
        for command in ("relay", "worker")
        for kind, changes, needle in (
            ("db-port-x", {"PIPELINE_DATABASE_URL": "{db}port=x"}, BAD_PORT),
            ("redis-port-x", {"PIPELINE_REDIS_URL": "redis://127.0.0.1:x/0"}, BAD_PORT),
            ("redis-bracket", {"PIPELINE_REDIS_URL": "redis://[::1/0"}, "is not a valid URL"),
            ("redis-notadb", {"PIPELINE_REDIS_URL": "redis://127.0.0.1/notadb"}, "not a number"),
            ("lease-inf", {"PIPELINE_LEASE_SECONDS": "inf"}, "PIPELINE_LEASE_SECONDS:"),
            ("batch-size", {"PIPELINE_BATCH_SIZE": "3000000000"}, "PIPELINE_BATCH_SIZE:"),
            (
                "prune-inf",
                {"PIPELINE_PRUNE_INTERVAL_SECONDS": "inf"},
                "PIPELINE_PRUNE_INTERVAL_SECONDS:",
            ),
        )
    ],
    # The worker runs the consumers: a declaration it cannot use stops it at import.
    *[
        (f"worker-{kind}", "worker", {"PIPELINE_APP_MODULES": app}, needle)
        for kind, app, needle in (
            (
                "consumer-string-types",
                "tests.apps.hostile_letters_app",
                "event types must be a list",
            ),
            (
                "consumer-time-limit-nan",
                "tests.apps.hostile_time_limit_app",
                "time_limit must be a number of seconds above 0",
            ),
        )
    ],
]


@pytest.mark.parametrize(
    ("command", "changes", "needle"),
    [case[1:] for case in PROCESS_CASES],
    ids=[case[0] for case in PROCESS_CASES],
)
def test_a_relay_or_worker_refuses_at_start_with_one_line(
    base_env: dict[str, str], command: str, changes: dict[str, str], needle: str
) -> None:
    result = run_cli_process([command], _spoil(base_env, changes), timeout=60)
    line = one_line(result, 1, needle)
    assert line.startswith("pipeline: error: ")


@pytest.mark.parametrize("command", ["relay", "worker"])
def test_a_relay_or_worker_with_the_producer_role_names_its_missing_grants(
    deployment: Deployment,  # noqa: F811 - the fixture imported above
    command: str,
) -> None:
    # "insecure": message authentication is not what this test is about (no warning line)
    env = deployment.env("producer", PIPELINE_MESSAGE_KEY="insecure")
    result = run_cli_process([command], env, timeout=60)
    line = one_line(result, 1, f"`pipeline {command}` needs (the grants are in docs/security.md)")
    role = deployment.role("producer")
    assert line.startswith(
        f"pipeline: error: permission denied: the database role {role!r} lacks "
    ), line
    assert "SELECT on pipeline.schema_migrations" in line


# -- what is printed, and what the database takes ----------------------------------------------

SPOOF = "o-1\x1b]0;pwned\x07\nFAKE: all healthy\u202e"


def test_trace_and_dlq_escape_control_characters_of_event_fields(
    settings: Settings, engine: Engine, redis_namespace: str
) -> None:
    with engine.begin() as conn:
        event_id = add_event(
            conn, "order.placed", {"n": 1}, aggregate_type="order\x1b[2J", aggregate_id=SPOOF
        )
        conn.execute(
            text(
                "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, event_type,"
                " reason, error_class, error) VALUES ('consume', :id, 'billing',"
                " 'order.placed', :reason, 'Boom', :error)"
            ),
            {"id": event_id, "reason": f"failed on {SPOOF}", "error": "bad\x1b[31m red"},
        )
        # sent to no consumer, so `dlq unrouted` lists its aggregate too
        conn.execute(
            text(
                "UPDATE pipeline.outbox SET status = 'sent', consumers = '{}',"
                " published_at = clock_timestamp() WHERE id = :id"
            ),
            {"id": event_id},
        )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")},
        "PIPELINE_DATABASE_URL": settings.require_database_url(),
        "PIPELINE_REDIS_URL": settings.require_redis_url(),
        "PIPELINE_REDIS_NAMESPACE": redis_namespace,
    }
    dead_letter_id = str(
        psycopg.connect(settings.require_database_url(), autocommit=True)
        .execute("SELECT id FROM pipeline.dead_letters")
        .fetchone()[0]  # type: ignore[index]
    )
    for argv in (
        ["trace", str(event_id)],
        ["dlq", "list"],
        ["dlq", "show", dead_letter_id],
        ["dlq", "unrouted"],
    ):
        result = run_cli(argv, env)
        assert result.returncode == 0, (argv, result.stderr)
        output = result.stdout
        assert "\x1b" not in output and "\x07" not in output and "\u202e" not in output, argv
        assert "\nFAKE: all healthy" not in output, argv
        assert "\\x1b" in output, (argv, output)
    shown = run_cli(["dlq", "show", dead_letter_id], env).stdout
    assert "o-1\\x1b]0;pwned\\x07\\x0aFAKE: all healthy\\u202e" in shown
