"""No loss whatever fails in Postgres: real relay and worker processes against real servers.

Each test reproduces a fault that once lost events or stopped a process: worker connections
killed in the middle of handlers, and connections killed while the relay and workers start.
(Broker faults are in ``test_broker_losses.py``.)
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from tests.chaos.orders import (
    APP,
    assert_each_stage_once,
    place_orders,
    wait_all_notified,
)
from tests.support import (
    soak,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)


@pytest.mark.soak
def test_worker_connections_killed_mid_handler_lose_nothing(engine, chaos_settings, tmp_path):
    """Postgres drops the workers' connections while handlers run, five times: every
    message they were handling is retried, and every stage runs once per order."""
    orders = [f"kill-{i}" for i in range(soak(300, 600))]
    place_orders(engine, orders)  # first: the killer must not hit the test's own connections
    relay = start_relay(chaos_settings, APP, tmp_path / "relay.log")
    workers = start_worker(
        chaos_settings,
        APP,
        tmp_path / "worker.log",
        2,
        4,
        TEST_HANDLER_SLEEP="0.01",
        PGAPPNAME="test-worker",  # the killer picks the workers' connections by this name
    )
    killed: list[int] = []
    last_kill = [0.0]

    def kill_connections() -> None:
        deadline = time.monotonic() + 60
        while len(killed) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
            with engine.connect() as conn:
                victims = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "AND state = 'idle in transaction' AND application_name = 'test-worker'"
                    )
                ).scalar()
                conn.commit()
            if victims:
                killed.append(int(victims))
                last_kill[0] = time.monotonic()

    killer = threading.Thread(target=kill_connections)
    try:
        killer.start()
        killer.join(90)
        wait_all_notified(engine, orders, [relay, workers])
        recovered = time.monotonic() - last_kill[0]
        time.sleep(1.0)  # any late duplicate would show now
    finally:
        stop_process(workers)
        stop_process(relay)
    print(f"\nevery order through every stage {recovered:.1f} s after the last kill")
    assert len(killed) == 5, f"connections killed inside handlers only {len(killed)} times"
    assert_each_stage_once(engine, orders)
    log = (tmp_path / "worker.log").read_text()
    failures = [line for line in log.splitlines() if "failed outside its handlers" in line]
    assert failures and all("message_id=" in line for line in failures)
    assert "Traceback" not in log  # an expected outage: one line each, no traceback
    assert "kill-" not in log  # no message payloads (the order ids)


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
        wait_all_notified(engine, orders, [relay, workers])
    finally:
        stop_killing.set()
        killer.join(10)
        stop_process(workers)
        stop_process(relay)
    assert sum(killed) > 0, "the killer found no connection to terminate"
    assert_each_stage_once(engine, orders)
