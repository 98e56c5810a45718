"""Credentials never show: not in CLI output (text or JSON), logs, errors or exported spans.

Every command runs with URLs that carry a password, against a server that is down, one
that rejects the password, and one that accepts it. Relays and workers run as real
processes (their logs are the subject); one-shot commands run in this process through
click's ``CliRunner``, their log records checked too, and a few as real processes.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from urllib.parse import quote

import psycopg
import pytest
import redis
from opentelemetry.sdk.trace import ReadableSpan

from pipeline import NewEvent, Settings, configure
from pipeline.config import load_settings
from pipeline.redaction import redact_secrets, redact_url
from pipeline.registry import Registry
from pipeline.relay.canary import emit_canary
from pipeline.runtime import build_runtime
from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis
from tests.integration.conftest import drainer_for
from tests.integration.test_observability import spans  # noqa: F401 - the fixture
from tests.support import (
    Ran,
    cli_argv,
    pipeline_env,
    produce,
    run_cli,
    run_cli_process,
    start_process,
    stop_process,
    wait_until,
)

SECRET = "s3cr3t-pw"
REDIS_SECRET = "r3dis-pw"
QUOTED = quote(SECRET + "/@", safe="")  # as written in a URL: s3cr3t-pw%2F%40
RIGHT = "the-right-password"
EVENT_ID = "0190a5a0-0000-7000-8000-000000000000"
APP = "tests.apps.roles_app"
COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["trace", EVENT_ID],
    ["trace", EVENT_ID, "--json"],
    ["db", "upgrade"],
    ["db", "pending"],
]
SERVING = [["relay", "--metrics-port", "0"], ["worker", "--metrics-port", "0"]]
"""Long-running commands: with a server missing or refusing they wait, logging why."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Keep(logging.Handler):
    """Keeps every log record a command makes, formatted with its traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def run(env: dict[str, str], args: list[str]) -> Ran:
    """``pipeline ARGS`` in this process (click's ``CliRunner``).

    Its stdout and stderr are the command's; every log record it makes, at any level, is
    checked for secrets too (a child process would print warnings and up; this sees more).
    """
    keep, root = _Keep(), logging.getLogger()
    level = root.level
    root.addHandler(keep)
    root.setLevel(logging.DEBUG)
    try:
        ran = run_cli(args, env)
    finally:
        root.removeHandler(keep)
        root.setLevel(level)
    logged = "\n".join(keep.lines)
    for secret in (SECRET, REDIS_SECRET, QUOTED):
        assert secret not in logged, logged
    return ran


def assert_refused_without_secrets(result: Ran, *secrets: str) -> str:
    """Exit 1, one line on stderr, nothing on stdout, no traceback and no secret."""
    output = result.stdout + result.stderr
    for secret in secrets:
        assert secret not in output, output
    assert "Traceback" not in output, output
    assert result.returncode == 1, output
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pipeline: error: "), line
    return line


def env_for(settings: Settings, **urls: str) -> dict[str, str]:
    return pipeline_env(settings, APP, PIPELINE_WORKER_METRICS_PORT="0", **urls)


# -- a server that is not there ----------------------------------------------------------------


def assert_waits_without_secrets(env: dict[str, str], args: list[str], log, *secrets: str) -> str:
    """A relay or worker that cannot use its server waits (one line per try, naming the
    server), stops cleanly on SIGTERM, and never prints a secret or a traceback."""
    process = start_process(cli_argv(*args), env, log)
    try:
        wait_until(lambda: "next try in" in log.read_text(), timeout=60)
    finally:
        stop_process(process)
    output = log.read_text()
    for secret in secrets:
        assert secret not in output, output
    assert "Traceback" not in output, output
    assert process.returncode == 0, output
    return output


@pytest.mark.parametrize("args", SERVING, ids=" ".join)
def test_a_serving_process_waits_for_an_unreachable_server_without_the_password(
    settings, args, tmp_path
):
    env = env_for(
        settings,
        PIPELINE_DATABASE_URL=f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/x",
        PIPELINE_REDIS_URL=f"redis://:{REDIS_SECRET}@127.0.0.1:{free_port()}/0",
    )
    output = assert_waits_without_secrets(env, args, tmp_path / "p.log", SECRET, REDIS_SECRET)
    assert "Postgres at 127.0.0.1:" in output


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_an_unreachable_server_is_named_without_the_password(settings, args):
    env = env_for(
        settings,
        PIPELINE_DATABASE_URL=f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/x",
        PIPELINE_REDIS_URL=f"redis://:{REDIS_SECRET}@127.0.0.1:{free_port()}/0",
    )
    line = assert_refused_without_secrets(run(env, args), SECRET, REDIS_SECRET)
    assert "Postgres at 127.0.0.1:" in line


@pytest.mark.parametrize("args", [["status", "--json"], ["db", "upgrade"]], ids=" ".join)
def test_a_real_process_names_an_unreachable_server_without_the_password(settings, args):
    """End to end: what a shell sees of a child process, logging as the console script."""
    env = env_for(
        settings,
        PIPELINE_DATABASE_URL=f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/x",
        PIPELINE_REDIS_URL=f"redis://:{REDIS_SECRET}@127.0.0.1:{free_port()}/0",
    )
    line = assert_refused_without_secrets(run_cli_process(args, env), SECRET, REDIS_SECRET)
    assert "Postgres at 127.0.0.1:" in line


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (f"postgresql://app:{SECRET}@[::1/x", "is not a valid URL (Invalid IPv6 URL)"),
        (f"postgresql://app:{SECRET}@127.0.0.1:port/x", "its port is not a number"),
        (f"postgresql://app:{SECRET}@host%zz/x", 'invalid percent-encoded token: "host%zz"'),
        (
            f"postgresql://app@127.0.0.1:5/x?password={SECRET}&sslmode=no",
            'invalid sslmode value: "no"',
        ),
        (
            f"postgresql://app@127.0.0.1:5/x?password={SECRET}&bogus=1",
            'invalid URI query parameter: "bogus"',
        ),
        (f"postgresql://app:{QUOTED}@h:5/x?x", "missing key/value separator"),
    ],
    ids=["ipv6", "port", "percent", "sslmode", "option", "quoted"],
)
@pytest.mark.parametrize("args", [["status"], ["db", "upgrade"]], ids=" ".join)
def test_an_unparseable_url_is_refused_without_the_password(settings, url, reason, args):
    result = run(env_for(settings, PIPELINE_DATABASE_URL=url), args)
    line = assert_refused_without_secrets(result, SECRET, QUOTED)
    assert reason in line


def test_redaction_covers_every_place_a_url_holds_a_password():
    url = f"postgresql://app:{quote(SECRET + '@')}@h:5/db?sslpassword=k3y&password={SECRET}x"
    assert redact_url(url) == "postgresql://app:***@h:5/db?sslpassword=***&password=***"
    text = f"bad {url} and {SECRET}@ and k3y"
    assert redact_secrets(text, url) == f"bad {redact_url(url)} and *** and ***"
    with pytest.raises(Exception) as raised:
        load_settings(database_url=f"postgresql://app:{SECRET}@[::1/x")
    assert SECRET not in str(raised.value)


# -- a server that rejects the password --------------------------------------------------------


@pytest.fixture(scope="module")
def password_postgres() -> Iterator[EmbeddedPostgres]:
    """A private Postgres where role ``app`` must give its password (scram-sha-256)."""
    server = EmbeddedPostgres(durable=False)
    server.start()
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE app LOGIN PASSWORD '{RIGHT}'")
            hba = str(conn.execute("SHOW hba_file").fetchone()[0])  # type: ignore[index]
            with open(hba, encoding="utf-8") as handle:
                rules = handle.read()
            with open(hba, "w", encoding="utf-8") as handle:
                handle.write("host all app 127.0.0.1/32 scram-sha-256\n" + rules)
            conn.execute("SELECT pg_reload_conf()")
        yield server
    finally:
        server.cleanup()


def test_the_private_server_does_check_passwords(password_postgres):
    good = f"postgresql://app:{RIGHT}@127.0.0.1:{password_postgres.port}/postgres"
    psycopg.connect(good).close()
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(good.replace(RIGHT, SECRET)).close()


@pytest.mark.parametrize("args", SERVING, ids=" ".join)
def test_a_serving_process_waits_on_a_rejected_password_without_repeating_it(
    settings, password_postgres, args, tmp_path
):
    url = f"postgresql://app:{SECRET}@127.0.0.1:{password_postgres.port}/postgres"
    output = assert_waits_without_secrets(
        env_for(settings, PIPELINE_DATABASE_URL=url), args, tmp_path / "p.log", SECRET
    )
    assert 'password authentication failed for user "app"' in output


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_rejected_password_is_not_repeated(settings, password_postgres, args):
    url = f"postgresql://app:{SECRET}@127.0.0.1:{password_postgres.port}/postgres"
    result = run(env_for(settings, PIPELINE_DATABASE_URL=url), args)
    line = assert_refused_without_secrets(result, SECRET)
    assert 'password authentication failed for user "app"' in line


@pytest.fixture
def password_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.config_set("requirepass", RIGHT)
        client.close()
        yield server
    finally:
        server.cleanup()


def test_status_with_a_rejected_redis_password_is_one_line(settings, password_redis):
    url = f"redis://:{REDIS_SECRET}@127.0.0.1:{password_redis.port}/0"
    for args in (["status"], ["status", "--json"]):
        line = assert_refused_without_secrets(run(env_for(settings, PIPELINE_REDIS_URL=url), args))
        assert REDIS_SECRET not in line
        assert line.startswith("pipeline: error: cannot use Redis at redis://:***@127.0.0.1:")


def test_relay_and_worker_logs_never_hold_a_rejected_redis_password(
    settings, engine, password_redis, tmp_path
):
    url = f"redis://:{REDIS_SECRET}@127.0.0.1:{password_redis.port}/0"
    env = env_for(settings, PIPELINE_REDIS_URL=url, PIPELINE_METRICS_PORT="0")
    relay = start_process(cli_argv("relay"), env, tmp_path / "r.log")
    worker = start_process(
        cli_argv("worker", "--processes", "1"),
        env,
        tmp_path / "w.log",
    )
    try:
        produce(engine, [NewEvent("role.order", {"order": "o1"})])
        # both wait at start-up for a Redis that accepts them, naming the refusal
        wait_until(lambda: "AuthenticationError" in (tmp_path / "r.log").read_text(), timeout=30)
        wait_until(lambda: "AuthenticationError" in (tmp_path / "w.log").read_text(), timeout=30)
    finally:
        stop_process(relay)
        stop_process(worker)
    for log in (tmp_path / "r.log", tmp_path / "w.log"):
        assert REDIS_SECRET not in log.read_text(), log


# -- a server that accepts it: what runs exports nothing of it --------------------------------


def with_password(url: str) -> str:
    scheme, rest = url.split("://", 1)
    userinfo, _, host = rest.rpartition("@")
    return f"{scheme}://{userinfo or 'postgres'}:{SECRET}@{host}"


def span_text(span: ReadableSpan) -> str:
    parts = [span.name, repr(dict(span.attributes or {})), str(span.status.description)]
    parts += [repr(dict(span.resource.attributes))]
    parts += [f"{e.name} {dict(e.attributes or {})}" for e in span.events]
    parts += [repr(dict(link.attributes or {})) for link in span.links]
    return " ".join(parts)


def test_spans_carry_no_connection_details(settings, spans):  # noqa: F811
    secret_settings = settings.replace(database_url=with_password(settings.require_database_url()))
    configure(secret_settings)
    consumers = Registry()
    consumers.subscribe("audit", ["*"])
    runtime = build_runtime(secret_settings, consumers, set_global_broker=False)
    from sqlalchemy import create_engine

    engine = create_engine(secret_settings.sqlalchemy_url())
    try:
        produce(engine, [NewEvent("role.order", {"order": "o1"}, aggregate_id="o1")])
        with psycopg.connect(secret_settings.require_database_url(), autocommit=True) as conn:
            emit_canary(conn, secret_settings.schema_name)
        assert drainer_for(runtime).run_batch().sent == 2
    finally:
        engine.dispose()
        runtime.close()
        configure(settings)
    exported = spans.get_finished_spans()
    assert {s.name.split(" ")[0] for s in exported} >= {"create", "send"}
    for span in exported:
        text = span_text(span)
        assert SECRET not in text, text
        host = settings.require_database_url().split("@", 1)[-1].split("/", 1)[0]
        assert host not in text, text
        for key in (*(span.attributes or {}), *span.resource.attributes):
            assert not key.startswith(("db.", "server.", "net.", "url.")), key


def test_processes_exporting_spans_to_the_console_print_no_password(settings, engine, tmp_path):
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE role_effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "consumer text NOT NULL, event_id uuid NOT NULL, UNIQUE (consumer, event_id))"
        )
    env = env_for(
        settings,
        PIPELINE_DATABASE_URL=with_password(settings.require_database_url()),
        PIPELINE_METRICS_PORT="0",
        OTEL_TRACES_EXPORTER="console",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    relay = start_process(cli_argv("relay"), env, tmp_path / "r.log")
    worker = start_process(
        cli_argv("worker", "--processes", "1"),
        env,
        tmp_path / "w.log",
    )
    try:
        produce(engine, [NewEvent("role.order", {"order": "o1"}, aggregate_id="o1")])
        wait_until(lambda: '"name": "process role.shipped"' in (tmp_path / "w.log").read_text(), 60)
        wait_until(
            lambda: '"name": "send pipeline.role_orders"' in (tmp_path / "r.log").read_text()
        )
        time.sleep(0.3)  # one more export round for the last spans
    finally:
        stop_process(relay)
        stop_process(worker)
    for log in (tmp_path / "r.log", tmp_path / "w.log"):
        text = log.read_text()
        assert SECRET not in text, log
        assert "Traceback" not in text, log
