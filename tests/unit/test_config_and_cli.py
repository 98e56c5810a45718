"""Bad configuration gives one clear line (naming the variable), never a traceback or a secret.

The commands run in this process through click's ``CliRunner`` (the ``pipeline`` group
ends a run exactly as the console script does); only the worker's check, which builds a
runtime and imports an app module into process-wide state, runs in a child process.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.config import Settings, load_settings
from pipeline.errors import ConfigurationError
from pipeline.redaction import redact_url
from pipeline.tools.cli import cli
from tests.support import cli_argv


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, **env: str) -> Ran:
    """``pipeline ARGS`` in-process, with no PIPELINE_* variable but those given."""
    cleared: dict[str, str | None] = {k: None for k in os.environ if k.startswith("PIPELINE_")}
    result = CliRunner().invoke(
        cli, list(args), env={**cleared, **env}, prog_name="pipeline", catch_exceptions=False
    )
    return Ran(result.exit_code, result.stdout, result.stderr)


def run_cli_process(*args: str, **env: str) -> Ran:
    """``python -m pipeline.tools.cli ARGS`` in a child process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    clean.update(env)
    done = subprocess.run(
        cli_argv(*args),
        check=False,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Ran(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PIPELINE_BATCH_SIZE": "lots"}, "PIPELINE_BATCH_SIZE: Input should be a valid integer"),
        ({"PIPELINE_BATCH_SIZE": "0"}, "PIPELINE_BATCH_SIZE: Input should be greater than 0"),
        ({"PIPELINE_SCHEMA_NAME": "Bad-Name"}, "PIPELINE_SCHEMA_NAME: use 1-63"),
        ({"PIPELINE_REDIS_URL": "http://x"}, "PIPELINE_REDIS_URL: must start with"),
        (
            {"PIPELINE_DATABASE_URL": "mysql://x"},
            "PIPELINE_DATABASE_URL: must start with postgresql://",
        ),
        ({"PIPELINE_LOG_FORMAT": "xml"}, "PIPELINE_LOG_FORMAT"),
        (
            {"PIPELINE_WORKER_TIMEOUT_MS": "5000"},
            "PIPELINE_WORKER_TIMEOUT_MS: Input should be less than or equal to 1000",
        ),
    ],
)
def test_invalid_setting_is_one_line_naming_the_variable(env, message):
    result = run_cli("db", "upgrade", **env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pipeline: error: ") and message in lines[0]
    assert "Traceback" not in result.stderr


def test_missing_database_url_is_named():
    result = run_cli("db", "upgrade")
    assert result.returncode == 1
    assert result.stderr.strip() == "pipeline: error: PIPELINE_DATABASE_URL is not set"


def test_unreachable_database_is_one_line_without_the_password():
    result = run_cli(
        "db", "upgrade", PIPELINE_DATABASE_URL="postgresql://app:s3cret-pw@127.0.0.1:1/appdb"
    )
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "127.0.0.1:1/appdb" in result.stderr
    assert "s3cret-pw" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_every_command_has_help():
    def walk(group, prefix):
        for name, command in group.commands.items():
            yield [*prefix, name]
            if hasattr(command, "commands"):
                yield from walk(command, [*prefix, name])

    commands = list(walk(cli, []))
    assert ["relay"] in commands and ["worker"] in commands and ["db", "upgrade"] in commands
    for path in [[], *commands]:
        result = run_cli(*path, "--help")
        assert result.returncode == 0, (path, result.stderr)
        assert "Usage:" in result.stdout


def test_unknown_command_is_a_usage_error():
    result = run_cli("frobnicate")
    assert result.returncode == 2
    assert "No such command" in result.stderr


def test_settings_hide_secrets():
    settings = Settings(
        database_url="postgresql://u:hunter2@h/db", redis_url="rediss://:pw@h:6380/0"
    )
    assert "hunter2" not in repr(settings) and "pw@" not in repr(settings)
    assert settings.require_redis_url().startswith("rediss://")  # TLS URLs are accepted
    assert redact_url("postgresql://u:hunter2@h:5/db") == "postgresql://u:***@h:5/db"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_replace_validates():
    with pytest.raises(ConfigurationError, match="PIPELINE_SCHEMA_NAME"):
        load_settings().replace(schema_name="no spaces allowed")


def test_sqlalchemy_url_uses_psycopg3():
    settings = Settings(database_url="postgres://u@h/db")
    assert settings.sqlalchemy_url() == "postgresql+psycopg://u@h/db"
    assert settings.require_database_url() == "postgresql://u@h/db"


# A bad value for every setting; the test below fails when a setting is added without one.
BAD_VALUES = {
    "database_url": "mysql://x",
    "redis_url": "http://x",
    "broker_url": "kafka://x",
    "broker_management_url": "localhost:15672",
    "broker_consumer_timeout_ms": "0",
    "broker_prefetch_max": "0",
    "broker_confirm_timeout": "-1",
    "schema_name": "Bad-Name",
    "redis_namespace": "has space",
    "app_modules": "no_such_module_for_pipeline_tests",
    "max_payload_bytes": "0",
    "unordered_event_types": "[1, 2]",
    "batch_size": "lots",
    "max_events_per_message": "0",
    "lease_seconds": "-1",
    "poll_interval_busy": "fast",
    "busy_poll_rate": "0",
    "poll_interval_min": "0",
    "poll_interval_max": "-2",
    "reconnect_backoff_max": "0",
    "publishers_in_flight": "0",
    "publish_max_attempts": "1.5",
    "publish_backoff_base": "0",
    "publish_backoff_max": "never",
    "worker_timeout_ms": "5000",
    "broker_heartbeat_timeout_ms": "0",
    "broker_maintenance_chance": "2000000",
    "inbox_retention_seconds": "0",
    "consumer_max_retries": "-1",
    "consumer_backoff_min": "0",
    "consumer_backoff_max": "x",
    "metrics_host": "not a host",
    "metrics_port": "70000",
    "worker_metrics_port": "-1",
    "metrics_multiproc_dir": "/dev/null",
    "state_metrics_interval": "0",
    "log_format": "xml",
    "log_level": "LOUD",
    "trace_ui_url": "jaeger.local:16686/{span}",
    "canary_interval": "-1",
    "redelivery_horizon_seconds": "0",
    "reconcile_interval_seconds": "soon",
    "sent_retention_seconds": "0",
    "attempts_retention_seconds": "-5",
    "audit_retention_seconds": "forever",
    "prune_interval_seconds": "-1",
    "prune_batch_size": "0",
    "allow_unrouted": "maybe",
    "backlog_warn": "-1",
    "backlog_limit": "many",
    "message_key": "too-short-a-secret",
    "message_key_previous": "too-short-a-secret",
    "lock_timeout_ms": "-1",
    "statement_timeout_ms": "1.5",
    "idle_in_transaction_timeout_ms": "never",
    "tcp_keepalives_idle_seconds": "-10",
    "finished_ids_kept": "10",  # below 1,000: a duplicate would soon read as a lost delivery
    "heartbeat_stale_seconds": "1",  # below 5 s: a live process (2 s refreshes) would be stale
    "heartbeat_gone_seconds": "nan",
}


def test_every_setting_has_a_bad_value_below():
    assert set(BAD_VALUES) == set(Settings.model_fields)


def assert_one_line(result: Ran, *needles: str, code: int = 1) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
def test_a_bad_value_of_any_setting_is_one_line_naming_it(field):
    variable = f"PIPELINE_{field.upper()}"
    result = run_cli("status", **{variable: BAD_VALUES[field]})
    line = assert_one_line(result, f"pipeline: error: {variable}")
    assert len(line) > len(f"pipeline: error: {variable}: ") + 10  # says what is expected


def test_unordered_event_types_is_a_comma_separated_or_json_list():
    assert load_settings(unordered_event_types="order.placed").unordered_event_types == {
        "order.placed"
    }
    assert Settings().unordered_event_types == frozenset()
    result = run_cli("status", PIPELINE_UNORDERED_EVENT_TYPES="[1, 2]")
    assert_one_line(
        result, "PIPELINE_UNORDERED_EVENT_TYPES", "comma-separated", "JSON list of event types"
    )
    given = run_cli(
        "status",
        PIPELINE_UNORDERED_EVENT_TYPES="order.placed, order.paid",
        PIPELINE_DATABASE_URL="mysql://x",
    )
    assert_one_line(given, "PIPELINE_DATABASE_URL")  # the list itself was accepted


@pytest.mark.parametrize(
    ("low", "high", "values"),
    [
        ("poll_interval_min", "poll_interval_max", ("5", "1")),
        ("poll_interval_busy", "poll_interval_max", ("5", "1")),
        ("publish_backoff_base", "publish_backoff_max", ("5", "1")),
        ("consumer_backoff_min", "consumer_backoff_max", ("5", "1")),
        ("heartbeat_stale_seconds", "heartbeat_gone_seconds", ("30", "20")),
    ],
)
def test_a_lower_bound_above_its_upper_bound_is_refused(low, high, values):
    low_name, high_name = f"PIPELINE_{low.upper()}", f"PIPELINE_{high.upper()}"
    result = run_cli("status", **{low_name: values[0], high_name: values[1]})
    assert_one_line(result, low_name, high_name, "must not exceed")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["worker", "--processes", "0"], ["--processes", "0 is not in the range 1<=x<="]),
        (["worker", "--threads", "0"], ["--threads", "1<=x<="]),
        (["worker", "--threads", "many"], ["--threads", "not a valid integer"]),
        (["relay", "--mode", "fast"], ["--mode", "'auto', 'inline', 'workers'"]),
        (["relay", "--metrics-port", "99999"], ["--metrics-port", "0<=x<=65535"]),
        (["status", "--max-pending-age", "-1"], ["--max-pending-age", "0<=x<="]),
        (["status", "--max-dead-letters", "some"], ["--max-dead-letters", "integer"]),
        (["trace", "not-a-uuid"], ["'not-a-uuid' is not an event id (a UUID)"]),
        (["trace"], ["Missing argument 'EVENT_ID'"]),
        (["db", "upgrade", "now"], ["unexpected extra argument"]),
        (["demo", "--events", "0"], ["--events", "1<=x<="]),
        (["demo", "--duplicates", "2"], ["--duplicates", "0<=x<=1"]),
        (["relay", "--bogus"], ["No such option '--bogus'"]),
        (["demo", "--api-url", "localhost:8000"], ["--api-url", "http:// or https:// URL"]),
    ],
)
def test_a_bad_argument_is_one_line_naming_the_option(args, needles):
    result = run_cli(*args)
    line = assert_one_line(result, *needles, code=2)
    assert line.startswith("pipeline"), line
    assert "--help" in line


def test_worker_refuses_unknown_queues_and_dramatiq_options_before_connecting():
    env = {
        "PIPELINE_DATABASE_URL": "postgresql://u@127.0.0.1:1/db",
        "PIPELINE_REDIS_URL": "redis://127.0.0.1:1/0",
        "PIPELINE_APP_MODULES": "tests.apps.inbox_app",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    # A child process: the check builds a runtime (a global broker) and imports the app.
    queue = run_cli_process("worker", "-Q", "pipeline.nosuch", **env)
    assert_one_line(queue, "--queues", "pipeline.nosuch", "pipeline.ledger", code=2)
    extra = run_cli_process("worker", "--no-such-dramatiq-flag", **env)
    assert_one_line(extra, "--no-such-dramatiq-flag", code=2)


def test_a_refused_postgres_connection_is_one_clean_line_with_the_drivers_reason():
    url = "postgresql://app:s3cret-pw@127.0.0.1:1/appdb"
    for args in (["status"], ["trace", "0190a0a0-0000-7000-8000-000000000000"], ["db", "upgrade"]):
        result = run_cli(*args, PIPELINE_DATABASE_URL=url)
        line = assert_one_line(result, "127.0.0.1", "port 1", "Connection refused")
        assert "\t" not in result.stderr and "s3cret-pw" not in result.stderr + result.stdout
        assert line.startswith("pipeline: error: cannot"), line


def test_pipeline_redis_url_is_the_older_name_of_pipeline_broker_url(monkeypatch):
    monkeypatch.delenv("PIPELINE_BROKER_URL", raising=False)
    monkeypatch.setenv("PIPELINE_REDIS_URL", "redis://127.0.0.1:6379/0")
    old = load_settings()
    assert old.require_broker_url() == old.require_redis_url() == "redis://127.0.0.1:6379/0"
    assert not old.broker_is_amqp
    moved = old.replace(broker_url="amqp://guest:guest@127.0.0.1:5672/%2F")
    assert moved.require_redis_url() == "amqp://guest:guest@127.0.0.1:5672/%2F"
    assert moved.broker_is_amqp
    monkeypatch.setenv("PIPELINE_BROKER_URL", "amqp://127.0.0.1/%2F")
    result = run_cli("status", PIPELINE_BROKER_URL="amqp://a/", PIPELINE_REDIS_URL="redis://b/")
    assert_one_line(result, "PIPELINE_BROKER_URL and PIPELINE_REDIS_URL differ")
    monkeypatch.delenv("PIPELINE_REDIS_URL")
    result = run_cli("status", PIPELINE_BROKER_URL="kafka://x")
    assert_one_line(result, "PIPELINE_BROKER_URL", "amqp://")
