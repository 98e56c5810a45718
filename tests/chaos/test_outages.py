"""Relays and workers outlast Postgres and Redis outages, as real processes.

Each test runs its own servers where it stops them (a private Redis or Postgres), and
checks what an operator sees: the process keeps running, says once per backoff step
what it waits for and why, never prints a traceback, and delivers everything once the
server is back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy import create_engine, text

from pipeline import NewEvent, Settings, configure
from pipeline.db.migrate import upgrade
from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis
from tests.conftest import create_database
from tests.support import (
    Ran,
    cli_argv,
    log_size,
    pipeline_env,
    produce,
    queue_envelopes,
    run_cli,
    start_process,
    stop_process,
    wait_until,
    worker_argv,
)

RELAY_APP = "tests.apps.relay_app"
INBOX_APP = "tests.apps.inbox_app"
NEXT_TRY = re.compile(r"next try in (\d+(?:\.\d+)?)s")
QUIET = {"PIPELINE_METRICS_PORT": "0", "PIPELINE_WORKER_METRICS_PORT": "0"}
# Waits of 0.5 s then 1 s: the backoff still shows its steps growing, and a process
# notices a server that came back within a second.
FAST_BACKOFF = {"PIPELINE_RECONNECT_BACKOFF_MAX": "1", **QUIET}


def relay(settings: Settings, app: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    argv = cli_argv("relay")
    return start_process(argv, pipeline_env(settings, app, **FAST_BACKOFF, **env), log)


def worker(settings: Settings, app: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    argv = worker_argv(1, 2)
    return start_process(argv, pipeline_env(settings, app, **FAST_BACKOFF, **env), log)


def lines(log: Path, *needles: str, since: int = 0) -> list[str]:
    text_ = log.read_text(errors="replace")[since:]
    return [line for line in text_.splitlines() if all(n in line for n in needles)]


def delays(found: list[str]) -> list[float]:
    return [float(m.group(1)) for line in found if (m := NEXT_TRY.search(line))]


def assert_backoff_steps(found: list[str], minimum: int = 3) -> None:
    """At least ``minimum`` steps, one line each, each waiting at least as long as the last."""
    waits = delays(found)
    assert len(waits) == len(found) >= minimum, found
    assert waits == sorted(waits) and waits[-1] > waits[0], waits


def assert_clean(log: Path) -> None:
    content = log.read_text(errors="replace")
    assert "Traceback" not in content, content[-4000:]
    assert "CRITICAL" not in content, content[-4000:]


def outbox_counts(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(text("SELECT status, count(*) FROM pipeline.outbox GROUP BY 1")).all()
        )


def scalar(engine, sql: str):
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


@pytest.fixture
def absent_redis() -> Iterator[EmbeddedRedis]:
    """A Redis whose URL is known but which is not started (the test starts it)."""
    server = EmbeddedRedis()
    _ = server.port  # pick the port now: processes are pointed at it before it runs
    try:
        yield server
    finally:
        server.cleanup()


def test_relay_started_while_redis_is_down_waits_then_publishes(
    engine, settings: Settings, absent_redis: EmbeddedRedis, tmp_path
):
    down = settings.replace(redis_url=absent_redis.url, lease_seconds=60.0)
    configure(down)
    ids = produce(engine, [NewEvent("order.placed", {"i": i}, aggregate_id="k") for i in range(20)])
    log = tmp_path / "relay.log"
    process = relay(down, RELAY_APP, log)
    try:
        wait_until(lambda: len(lines(log, "next try in")) >= 4 or process.poll() is not None, 60)
        assert process.poll() is None, log.read_text()[-4000:]
        found = lines(log, "next try in")
        assert all("Redis" in line and "Connection refused" in line for line in found), found
        assert_backoff_steps(found)
        # Nothing is left claimed while Redis is away (the lease is 60 s), no attempt counted.
        assert outbox_counts(engine) == {"pending": 20}
        assert scalar(engine, "SELECT max(attempts) FROM pipeline.outbox") == 0
        absent_redis.start()
        wait_until(lambda: outbox_counts(engine) == {"sent": 20}, timeout=60)
    finally:
        stop_process(process)
    assert process.returncode == 0, log.read_text()[-4000:]
    assert_clean(log)
    delivered = [e["id"] for e in queue_envelopes(down, "pipeline.audit")]
    assert delivered == [str(i) for i in ids]


def test_a_redis_refusing_writes_releases_claims_at_once_and_counts_no_attempt(
    engine, settings: Settings, tmp_path
):
    """Redis answering with errors (out of memory here) is an outage, not the events' fault."""
    server = EmbeddedRedis()
    server.start()
    try:
        full = settings.replace(redis_url=server.url, lease_seconds=60.0)
        configure(full)
        client = redis.Redis.from_url(server.url)
        log = tmp_path / "relay.log"
        process = relay(full, RELAY_APP, log)
        try:
            wait_until(lambda: lines(log, "relay started"), timeout=60)
            client.config_set("maxmemory", "1")  # every write now fails with OOM
            events = [NewEvent("order.placed", {"i": i}, aggregate_id="k") for i in range(5)]
            produce(engine, events)
            wait_until(lambda: len(lines(log, "next try in", "OOM")) >= 3, timeout=60)
            assert process.poll() is None
            assert outbox_counts(engine) == {"pending": 5}
            assert scalar(engine, "SELECT max(attempts) FROM pipeline.outbox") == 0
            assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
            client.config_set("maxmemory", "0")
            wait_until(lambda: outbox_counts(engine) == {"sent": 5}, timeout=60)
        finally:
            stop_process(process)
            client.close()
        assert process.returncode == 0, log.read_text()[-4000:]
        assert_clean(log)
        assert len(queue_envelopes(full, "pipeline.audit")) == 5
    finally:
        server.cleanup()


def cli(settings: Settings, *args: str) -> Ran:
    """``pipeline ARGS`` in this process: these commands start nothing."""
    return run_cli(args, pipeline_env(settings, INBOX_APP, **QUIET))


def test_relay_worker_and_trace_started_before_the_schema_exists(
    empty_database_url: str, settings: Settings, tmp_path
):
    fresh = settings.replace(database_url=empty_database_url)
    configure(fresh)
    engine = create_engine(fresh.sqlalchemy_url())
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE effects (id bigserial PRIMARY KEY, stage text NOT NULL,"
            " order_id text NOT NULL, event_id uuid NOT NULL)"
        )
    traced = cli(fresh, "trace", str(uuid.uuid4()))
    assert traced.returncode == 1, traced.stdout
    assert traced.stderr.strip().splitlines() == [
        "pipeline: error: the pipeline schema 'pipeline' is not installed: "
        "run `pipeline db upgrade`"
    ]
    relay_log, worker_log = tmp_path / "relay.log", tmp_path / "worker.log"
    processes = [relay(fresh, INBOX_APP, relay_log), worker(fresh, INBOX_APP, worker_log)]
    try:
        for log in (relay_log, worker_log):
            wait_until(lambda log=log: len(lines(log, "next try in")) >= 3, timeout=60)
            found = lines(log, "next try in")
            assert all("pipeline db upgrade" in line for line in found), found
            assert_backoff_steps(found)
        assert [p.poll() for p in processes] == [None, None]
        upgraded = cli(fresh, "db", "upgrade")
        assert upgraded.returncode == 0, upgraded.stderr
        produce(engine, [NewEvent("entry.booked", {"order_id": "o1"})])
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, timeout=90)
    finally:
        for process in processes:
            stop_process(process)
        engine.dispose()
    assert [p.returncode for p in processes] == [0, 0], worker_log.read_text()[-4000:]
    for log in (relay_log, worker_log):
        assert_clean(log)


@pytest.fixture
def own_postgres() -> Iterator[tuple[EmbeddedPostgres, str]]:
    """A Postgres of this test's own with a migrated database; returns (server, url)."""
    server = EmbeddedPostgres(durable=True)
    server.start()
    try:
        _, url = create_database(server.url)
        engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(url))
        with engine.begin() as conn:
            upgrade(conn, "pipeline")
        engine.dispose()
        yield server, url
    finally:
        server.cleanup()


def immediate_stop(server: EmbeddedPostgres) -> None:
    """What `pg_ctl stop -m immediate` does: SIGQUIT to the postmaster, no checkpoint."""
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGQUIT)
    wait_until(lambda: not server.is_running(), timeout=30)


def recovered(process: subprocess.Popen[bytes], log: Path, mark: int) -> None:
    """Wait until the relay says it publishes again after the outage logged past ``mark``."""
    wait_until(
        lambda: lines(log, "relay recovered", since=mark),
        timeout=60,
        progress=lambda: log_size(log),
        alive=[process],
    )


def test_relay_outlasts_immediate_restarts_and_a_postgres_outage(
    own_postgres: tuple[EmbeddedPostgres, str], settings: Settings, tmp_path
):
    server, url = own_postgres
    # An immediate stop loses the relay's last asynchronously committed `sent` marks: those
    # events are published again once their lease runs out, so a short lease keeps the
    # test to the restarts, not to the default 30 s lease.
    own = settings.replace(database_url=url, canary_interval=0.5, lease_seconds=2.0)
    configure(own)
    engine = create_engine(own.sqlalchemy_url(), pool_pre_ping=True)
    log = tmp_path / "relay.log"
    process = relay(own, RELAY_APP, log)
    total = 0
    try:

        def produce_and_wait(count: int) -> None:
            nonlocal total
            produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(count)])
            total += count
            wait_until(
                lambda: (
                    scalar(
                        engine,
                        "SELECT count(*) FROM pipeline.outbox"
                        " WHERE status = 'sent' AND event_type = 'order.placed'",
                    )
                    == total
                ),
                timeout=90,
            )

        wait_until(lambda: lines(log, "relay started"), timeout=60)
        produce_and_wait(10)
        for _ in range(2):  # immediate restarts: the relay reconnects while Postgres recovers
            mark = log.stat().st_size
            immediate_stop(server)
            server.start()
            recovered(process, log, mark)
            produce_and_wait(10)
        mark = log.stat().st_size
        immediate_stop(server)  # an outage long enough for several backoff steps
        wait_until(lambda: len(lines(log, "relay waiting", since=mark)) >= 5, timeout=60)
        assert process.poll() is None, log.read_text()[-4000:]
        outage = lines(log, "relay waiting", since=mark)
        assert_backoff_steps(outage, minimum=5)
        assert all("Connection refused" in line for line in outage[1:]), outage
        server.start()
        recovered(process, log, mark)
        produce_and_wait(10)
    finally:
        stop_process(process)
        engine.dispose()
    assert process.returncode == 0, log.read_text()[-4000:]
    assert_clean(log)
    found = lines(log, "next try in")
    assert all("Postgres" in line for line in found), found
    assert not [line for line in found if "\t" in line or "password" in line.lower()]


def test_worker_waits_for_redis_at_start_and_rides_out_an_outage(
    engine, settings: Settings, absent_redis: EmbeddedRedis, tmp_path
):
    from tests.integration.test_inbox import TABLES, publish_repeated

    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)
    own = settings.replace(redis_url=absent_redis.url, worker_timeout_ms=100)
    configure(own)
    log = tmp_path / "worker.log"
    process = worker(own, INBOX_APP, log)
    try:
        wait_until(lambda: len(lines(log, "next try in")) >= 3, timeout=60)
        assert process.poll() is None, log.read_text()[-4000:]
        at_start = lines(log, "next try in")
        assert all("Redis" in line and "Connection refused" in line for line in at_start)
        assert_backoff_steps(at_start)
        absent_redis.start()
        produce(engine, [NewEvent("entry.booked", {"order_id": "first"})])
        publish_repeated(own, times=1)
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, timeout=60)

        mark = log.stat().st_size
        absent_redis.kill()  # the running worker loses Redis
        wait_until(lambda: len(lines(log, "next try in", since=mark)) >= 4, timeout=60)
        assert process.poll() is None
        running = lines(log, "next try in", since=mark)
        assert all("Redis unreachable" in line for line in running), running
        assert all("Connection refused" in line for line in running[1:]), running  # [0]: reset
        assert_backoff_steps(running)
        absent_redis.start()  # same port, empty (no persistence)
        produce(engine, [NewEvent("entry.booked", {"order_id": "second"})])
        publish_repeated(own, times=1)
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 2, timeout=60)
    finally:
        stop_process(process)
    assert process.returncode == 0, log.read_text()[-4000:]
    assert_clean(log)
