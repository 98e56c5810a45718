"""No loss whatever fails: real relay and worker processes against real servers.

Each test reproduces a fault that once lost events: worker connections killed in the
middle of handlers, and a Redis that forgets everything it carried.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter

import pytest
from sqlalchemy import text

from pipeline import NewEvent, Settings, configure
from pipeline.tools.harness.embedded import EmbeddedRedis
from tests.support import (
    pipeline_env,
    produce,
    run_cli,
    soak,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.inbox_app"
STAGES = ("payments", "inventory", "notifications")
TABLES = """
CREATE TABLE effects (id bigserial PRIMARY KEY, stage text NOT NULL, order_id text NOT NULL,
                      event_id uuid NOT NULL);
CREATE TABLE seq_log (id bigserial PRIMARY KEY, ordering_key text NOT NULL, seq bigint NOT NULL,
                      n int NOT NULL);
"""


@pytest.fixture
def chaos_settings(settings: Settings, engine):
    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)
    value = settings.replace(
        lease_seconds=3.0,
        poll_interval_max=0.5,
        broker_heartbeat_timeout_ms=3000,
        broker_maintenance_chance=200_000,
        canary_interval=0,
        redelivery_horizon_seconds=3.0,
        reconcile_interval_seconds=0.5,
    )
    configure(value)
    yield value
    configure(settings)


def stage_counts(engine, stage: str) -> Counter:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT order_id FROM effects WHERE stage = :s"), {"s": stage})
        return Counter(row[0] for row in rows)


def scalar(engine, sql: str):
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def place_orders(engine, orders: list[str]) -> None:
    produce(
        engine,
        [
            NewEvent("order.placed", {"order_id": o}, aggregate_type="order", aggregate_id=o)
            for o in orders
        ],
        per_transaction=10,
    )


def assert_each_stage_once(engine, orders: list[str]) -> None:
    for stage in STAGES:
        assert stage_counts(engine, stage) == Counter(dict.fromkeys(orders, 1)), stage
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0


def status_json(settings: Settings) -> tuple[int, dict]:
    done = run_cli(["status", "--json"], pipeline_env(settings, APP))
    return done.returncode, json.loads(done.stdout)


@pytest.mark.soak
def test_worker_connections_killed_mid_handler_lose_nothing(engine, chaos_settings, tmp_path):
    """Postgres drops the workers' connections while handlers run, five times: every
    message they were handling is retried, and every stage runs once per order."""
    orders = [f"kill-{i}" for i in range(soak(300, 600))]
    place_orders(engine, orders)  # first: the killer must not hit the test's own connections
    relay = start_relay(chaos_settings, APP, tmp_path / "relay.log")
    workers = start_worker(
        chaos_settings, APP, tmp_path / "worker.log", 2, 4, TEST_HANDLER_SLEEP="0.01"
    )
    killed: list[int] = []

    def kill_connections() -> None:
        deadline = time.monotonic() + 60
        while len(killed) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
            with engine.connect() as conn:
                victims = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "AND state = 'idle in transaction'"
                    )
                ).scalar()
                conn.commit()
            if victims:
                killed.append(int(victims))

    killer = threading.Thread(target=kill_connections)
    try:
        killer.start()
        killer.join(90)
        wait_until(
            lambda: len(stage_counts(engine, "notifications")) == len(orders),
            timeout=60,
            interval=0.5,
            progress=lambda: scalar(engine, "SELECT count(*) FROM effects"),
            alive=[relay, workers],
        )
        time.sleep(1.0)  # any late duplicate would show now
    finally:
        stop_process(workers)
        stop_process(relay)
    assert len(killed) == 5, f"connections killed inside handlers only {len(killed)} times"
    assert_each_stage_once(engine, orders)
    log = (tmp_path / "worker.log").read_text()
    assert "message failed outside its handlers; it will be retried" in log
    assert "Failed to process message pipeline_inbox_" in log  # Dramatiq's own line...
    assert "kill-" not in log  # ...without the messages' payloads (the order ids)


@pytest.mark.soak
def test_a_redis_that_forgets_delays_events_but_loses_none(engine, chaos_settings, tmp_path):
    """Events sent to Redis, Redis restarted empty before any worker ran: `pipeline status`
    reports the deliveries owed past the horizon, and the relay's ledger sweep sends them
    again, so every stage still runs once per order."""
    orders = [f"forget-{i}" for i in range(soak(100, 300))]
    with EmbeddedRedis(tmp_path / "redis") as redis_server:
        settings = chaos_settings.replace(redis_url=redis_server.url)
        relay = start_relay(settings, APP, tmp_path / "relay.log")
        try:
            place_orders(engine, orders)
            wait_until(
                lambda: (
                    scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'")
                    == len(orders)
                ),
                timeout=60,
                progress=lambda: scalar(engine, "SELECT count(*) FROM pipeline.outbox"),
                alive=[relay],
            )
        finally:
            stop_process(relay)
        redis_server.kill()  # no persistence: every message is gone
        redis_server.start()
        time.sleep(settings.redelivery_horizon_seconds + 0.5)
        code, status = status_json(settings)
        assert code == 1 and not status["healthy"], status
        assert status["owed"] == {"payments": len(orders)}, status
        owed = f"{len(orders)} deliveries to payments"
        assert any(owed in p for p in status["problems"]), status
        event_id = scalar(engine, "SELECT id FROM pipeline.outbox ORDER BY seq LIMIT 1")
        traced = run_cli(["trace", str(event_id), "--json"], pipeline_env(settings, APP))
        assert traced.returncode == 0, traced.stderr
        (payments,) = json.loads(traced.stdout)["deliveries"]
        assert (payments["consumer"], payments["status"], payments["owed"]) == (
            "payments",
            "delivered",
            True,
        )

        relay = start_relay(settings, APP, tmp_path / "relay2.log")
        workers = start_worker(settings, APP, tmp_path / "worker.log", 2, 4)
        try:
            wait_until(
                lambda: len(stage_counts(engine, "notifications")) == len(orders),
                timeout=60,
                interval=0.5,
                progress=lambda: scalar(engine, "SELECT count(*) FROM effects"),
                alive=[relay, workers],
            )
            time.sleep(1.0)
            code, status = status_json(settings)
        finally:
            stop_process(workers)
            stop_process(relay)
    assert_each_stage_once(engine, orders)
    assert code == 0 and status["owed"] == {}, status
    redelivered = scalar(
        engine, "SELECT sum(redeliveries) FROM pipeline.inbox WHERE consumer = 'payments'"
    )
    assert redelivered >= len(orders)


def test_a_redis_that_restarts_empty_is_noticed_and_owed_deliveries_are_sent_at_once(
    engine, chaos_settings, tmp_path
):
    """Redis restarts without persistence under a running relay, its messages gone: the
    relay notices (its marker key vanished) and sends what is owed at once, long before
    the redelivery horizon (set to ten minutes here) would have."""
    orders = [f"amnesia-{i}" for i in range(soak(50, 300))]
    with EmbeddedRedis(tmp_path / "redis") as redis_server:
        settings = chaos_settings.replace(
            redis_url=redis_server.url, redelivery_horizon_seconds=600.0
        )
        relay = start_relay(settings, APP, tmp_path / "relay.log")
        workers = None
        try:
            place_orders(engine, orders)
            wait_until(
                lambda: (
                    scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'")
                    == len(orders)
                ),
                timeout=60,
                progress=lambda: scalar(engine, "SELECT count(*) FROM pipeline.outbox"),
                alive=[relay],
            )
            redis_server.kill()  # no persistence: every message is gone
            redis_server.start()
            wait_until(
                lambda: "the broker lost its messages" in (tmp_path / "relay.log").read_text(),
                timeout=60,
                alive=[relay],
            )
            workers = start_worker(settings, APP, tmp_path / "worker.log", 1, 4)
            wait_until(
                lambda: len(stage_counts(engine, "notifications")) == len(orders),
                timeout=60,
                interval=0.5,
                progress=lambda: scalar(engine, "SELECT count(*) FROM effects"),
                alive=[relay, workers],
            )
        finally:
            if workers is not None:
                stop_process(workers)
            stop_process(relay)
    assert_each_stage_once(engine, orders)
    redelivered = scalar(
        engine, "SELECT sum(redeliveries) FROM pipeline.inbox WHERE consumer = 'payments'"
    )
    assert redelivered == len(orders)  # each lost delivery sent again once, none twice
    assert (tmp_path / "relay.log").read_text().count("the broker lost its messages") == 1


def seq_log(engine) -> dict[str, list[int]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT ordering_key, n FROM seq_log ORDER BY id")).all()
    seen: dict[str, list[int]] = {}
    for key, n in rows:
        seen.setdefault(key, []).append(n)
    return seen


def steps(first: int, last: int, keys: int = 20) -> list[NewEvent]:
    return [
        NewEvent("seq.step", {"n": n}, ordering_key=f"key-{k}")
        for n in range(first, last)
        for k in range(keys)
    ]


def test_an_ordered_key_whose_events_redis_forgot_resumes_in_order(
    engine, chaos_settings, tmp_path
):
    """Steps 0-4 of each key processed; steps 5-9 sent, then Redis restarted empty; steps
    10-14 published after it. The later steps must not wait forever behind the lost ones:
    the sweep sends 5-9 again, and every key ends with 0..14 handled once, in order."""
    with EmbeddedRedis(tmp_path / "redis") as redis_server:
        settings = chaos_settings.replace(redis_url=redis_server.url)
        relay = start_relay(settings, APP, tmp_path / "relay.log")
        workers = start_worker(settings, APP, tmp_path / "worker.log", 1, 4)
        try:
            produce(engine, steps(0, 5), per_transaction=20)
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM seq_log") == 100, timeout=60)
            # Idle (steps 5-9 are not produced yet) and Redis is emptied below: nothing a
            # graceful stop would finish or hand back, so no need to wait for one.
            stop_process(workers, signal.SIGKILL)
            produce(engine, steps(5, 10), per_transaction=20)
            wait_until(
                lambda: (
                    scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'")
                    == 200
                ),
                timeout=60,
            )
            redis_server.kill()
            redis_server.start()
            workers = start_worker(settings, APP, tmp_path / "worker2.log", 1, 4)
            produce(engine, steps(10, 15), per_transaction=20)
            wait_until(
                lambda: scalar(engine, "SELECT count(*) FROM seq_log") == 300,
                timeout=60,
                interval=0.5,
                progress=lambda: scalar(engine, "SELECT count(*) FROM seq_log"),
                alive=[relay, workers],
            )
        finally:
            stop_process(workers)
            stop_process(relay)
    seen = seq_log(engine)
    assert len(seen) == 20
    for key, ns in seen.items():
        assert ns == list(range(15)), f"{key} handled out of order or twice: {ns}"


def test_connections_killed_while_relay_and_workers_start_are_waited_out(
    engine, chaos_settings, tmp_path
):
    """Every pipeline connection left idle inside a transaction is terminated while the relay
    and workers start (their start-up checks included): they wait the outage out, logging
    why, instead of exiting, and every order then goes through every stage once."""
    orders = [f"start-{i}" for i in range(20)]
    place_orders(engine, orders)
    stop_killing = threading.Event()
    killed: list[int] = []

    def kill_connections() -> None:
        with engine.connect() as conn:
            while not stop_killing.is_set():
                victims = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "AND state = 'idle in transaction'"
                    )
                ).scalar()
                conn.commit()
                killed.append(int(victims or 0))
                time.sleep(0.002)

    killer = threading.Thread(target=kill_connections)
    killer.start()
    relay = start_relay(chaos_settings, APP, tmp_path / "relay.log")
    workers = start_worker(chaos_settings, APP, tmp_path / "worker.log", 1, 2)
    try:
        wait_until(
            lambda: "relay started" in (tmp_path / "relay.log").read_text(),
            timeout=60,
            alive=[relay, workers],
        )
        time.sleep(3.0)  # the fault lasts through the workers' start-up too
        stop_killing.set()
        killer.join(10)
        wait_until(
            lambda: len(stage_counts(engine, "notifications")) == len(orders),
            timeout=60,
            interval=0.5,
            progress=lambda: scalar(engine, "SELECT count(*) FROM effects"),
            alive=[relay, workers],
        )
    finally:
        stop_killing.set()
        killer.join(10)
        stop_process(workers)
        stop_process(relay)
    assert sum(killed) > 0, "the killer found no connection to terminate"
    assert_each_stage_once(engine, orders)
