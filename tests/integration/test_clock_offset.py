"""A relay on a host whose clock runs ahead, seen by the heartbeats.

The relay runs under libfaketime with its wall clock shifted five seconds ahead: its
heartbeats store the offset against Postgres's clock, it exports it as
``pipeline_relay_clock_offset_seconds``, and ``pipeline doctor`` names it with its host
and pid. A relay and a worker on the true clock beside it are measured within a second
and not named.

The monotonic clock is left alone (``FAKETIME_DONT_FAKE_MONOTONIC``), as on a real host
whose wall clock is off: NTP and ``date -s`` move the wall clock only, and the relay
times its waits by the monotonic clock. Faking it too hangs every timed wait of any
Python process (libfaketime shifts ``clock_gettime(CLOCK_MONOTONIC)`` but not the
deadlines of ``sem_clockwait``); with it left alone, ``time.sleep`` fails instead
(libfaketime's ``clock_nanosleep`` returns EINVAL), which Dramatiq's worker loop calls
and the relay does not: so the worker runs on the true clock.

Within the tolerance (a second), relays whose clocks are off either way deliver a stream
of ordered events exactly once, in key order, and ``pipeline doctor`` finds nothing wrong.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import NewEvent, Settings
from pipeline.tools.harness.server import free_port
from tests.chaos.orders import APP as INBOX_APP
from tests.chaos.orders import TABLES, scalar
from tests.support import (
    installed_settings,
    pipeline_env,
    produce,
    run_cli,
    running_app_worker,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.relay_app"
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")


def shifted(offset: str) -> dict[str, str]:
    """The environment of a process whose wall clock is shifted by ``offset`` (``"+5s"``)."""
    return {"LD_PRELOAD": str(FAKETIME), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


AHEAD = shifted("+5s")
GAUGE = "pipeline_relay_clock_offset_seconds"


def offsets(engine, table: str, id_column: str) -> dict[int, float | None]:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT pid, clock_offset FROM pipeline.{table} ORDER BY {id_column}"
        ).all()
    return {int(pid): offset for pid, offset in rows}


def relay_offsets(engine, pids: tuple[int, ...], **wait: Any) -> dict[int, float | None]:
    """The relays' stored offsets, once each of ``pids`` has measured its own."""

    def measured() -> dict[int, float | None] | None:
        found = offsets(engine, "relay_state", "relay_id")
        return found if all(found.get(pid) is not None for pid in pids) else None

    result: dict[int, float | None] = wait_until(measured, interval=0.2, **wait)
    return result


def gauge(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == GAUGE:
                return float(sample.value)
    raise AssertionError(f"{GAUGE} is not exported")


MISSING = "libfaketime is missing: apt-get install faketime"


@pytest.mark.skipif(not FAKETIME.exists(), reason=MISSING)
def test_clocks_ahead_are_stored_exported_and_named_by_doctor(settings: Settings, engine, tmp_path):
    settings = settings.replace(canary_interval=0)
    skewed_port, true_port = free_port(), free_port()
    skewed = start_relay(
        settings, APP, tmp_path / "skewed.log", "--mode", "inline",
        "--metrics-port", str(skewed_port), **AHEAD,
    )  # fmt: skip
    true = start_relay(
        settings, APP, tmp_path / "true.log", "--mode", "inline",
        "--metrics-port", str(true_port),
    )  # fmt: skip
    worker = start_worker(
        settings, APP, tmp_path / "worker.log", 1, 1, PIPELINE_WORKER_METRICS_PORT="0"
    )
    try:
        relays = relay_offsets(
            engine, (skewed.pid, true.pid), timeout=60, alive=[skewed, true, worker]
        )
        assert 4.0 <= relays[skewed.pid] <= 6.0, relays
        assert abs(relays[true.pid]) < 1.0, relays
        workers = wait_until(
            lambda: [
                o for o in offsets(engine, "worker_state", "worker_id").values() if o is not None
            ],
            timeout=60,
            interval=0.2,
            alive=[skewed, true, worker],
        )
        assert len(workers) == 1 and abs(workers[0]) < 1.0, workers
        assert 4.0 <= gauge(skewed_port) <= 6.0
        assert abs(gauge(true_port)) < 1.0

        env = pipeline_env(settings, APP)
        doctor = run_cli(["doctor"], env)
        assert doctor.returncode == 1, doctor.stdout
        named = [line for line in doctor.stdout.splitlines() if "clock is" in line]
        host = socket.gethostname()
        assert len(named) == 1, doctor.stdout
        assert f"PROBLEM relay_clock: relay {host}-{skewed.pid}-" in named[0]
        assert f"({host} pid {skewed.pid}): its clock is" in named[0]
        assert "s ahead of the database's" in named[0]
        status = run_cli(["status"], env).stdout.splitlines()
        [line] = [line for line in status if f"pid {skewed.pid})" in line]
        assert "s ahead of the database's" in line
        [line] = [line for line in status if f"pid {true.pid})" in line]
        assert "clock" not in line
        rows = json.loads(run_cli(["status", "--json"], env).stdout)["relays"]
        shown = {row["pid"]: row["clock_offset_seconds"] for row in rows}
        assert 4.0 <= shown[skewed.pid] <= 6.0 and abs(shown[true.pid]) < 1.0, shown
        findings = json.loads(run_cli(["doctor", "--json"], env).stdout)["findings"]
        assert [f["status"] for f in findings if f["check"] == "relays"] == ["ok"]
    finally:
        for process in (skewed, true, worker):
            stop_process(process)


@pytest.mark.skipif(not FAKETIME.exists(), reason=MISSING)
def test_clocks_off_within_a_second_deliver_every_event_once_in_key_order(
    settings: Settings, engine, tmp_path
):
    """One relay 0.8 s ahead, one 0.8 s behind, a worker on the true clock: an ordered
    consumer handles every event of several keys once, in key order, and doctor is clean.

    The shifted clocks are the relays' (processes under libfaketime); the worker on the
    true clock is Dramatiq's worker in this process."""
    keys, steps = 6, 30
    with installed_settings(settings, engine, TABLES, canary_interval=0) as quick:
        ahead = start_relay(quick, INBOX_APP, tmp_path / "ahead.log", **shifted("+0.8s"))
        behind = start_relay(quick, INBOX_APP, tmp_path / "behind.log", **shifted("-0.8s"))
        processes = [ahead, behind]
        try:
            with running_app_worker(quick, INBOX_APP, threads=4):
                produce(
                    engine,
                    [
                        NewEvent("seq.step", {"n": n}, ordering_key=f"key-{k}")
                        for n in range(steps)
                        for k in range(keys)
                    ],
                    per_transaction=keys,  # one step of every key per transaction
                )
                wait_until(
                    lambda: scalar(engine, "SELECT count(*) FROM seq_log") >= keys * steps,
                    timeout=60,
                    interval=0.2,
                    alive=processes,
                    progress=lambda: scalar(engine, "SELECT count(*) FROM seq_log"),
                )
            relays = relay_offsets(engine, (ahead.pid, behind.pid), timeout=30, alive=processes)
            env = pipeline_env(quick, INBOX_APP)
            doctor = run_cli(["doctor", "--json"], env)
        finally:
            for process in processes:
                stop_process(process)
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT ordering_key, n FROM seq_log ORDER BY id").all()

    assert 0.5 <= relays[ahead.pid] < 1.0, relays
    assert -1.0 < relays[behind.pid] <= -0.5, relays
    seen: dict[str, list[int]] = {}
    for key, n in rows:
        seen.setdefault(key, []).append(n)
    assert seen == {f"key-{k}": list(range(steps)) for k in range(keys)}, seen
    findings = json.loads(doctor.stdout)["findings"]
    clock = [f for f in findings if f["check"] in ("clock", "relay_clock", "worker_clock")]
    assert [(f["check"], f["status"]) for f in clock] == [("clock", "ok")], clock
    assert doctor.returncode == 0, doctor.stdout
