"""Bad configuration gives one clear line (naming the variable), never a traceback or a secret."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.config import Settings, load_settings, redact_url
from pipeline.errors import ConfigurationError


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        check=False,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PIPELINE_BATCH_SIZE": "lots"}, "PIPELINE_BATCH_SIZE: Input should be a valid integer"),
        ({"PIPELINE_BATCH_SIZE": "0"}, "PIPELINE_BATCH_SIZE: Input should be greater than 0"),
        ({"PIPELINE_SCHEMA_NAME": "Bad-Name"}, "PIPELINE_SCHEMA_NAME: Value error, use 1-63"),
        ({"PIPELINE_REDIS_URL": "http://x"}, "PIPELINE_REDIS_URL: Value error, must start with"),
        ({"PIPELINE_DATABASE_URL": "mysql://x"}, "PIPELINE_DATABASE_URL: Value error"),
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
    from pipeline.cli import cli

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
