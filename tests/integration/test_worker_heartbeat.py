"""Worker liveness from the pipeline's own heartbeat, with real worker processes.

Each Dramatiq worker process keeps a row in ``worker_state``, refreshed while idle, so
``pipeline status`` and ``pipeline doctor`` list a live worker as alive, a paused one
(SIGSTOP: a frozen host, a stuck VM) as stale, a killed one as gone.
"""

from __future__ import annotations

import json
import os
import signal

from pipeline import Settings
from pipeline.heartbeat import WorkerHeartbeat
from pipeline.runtime import build_runtime
from tests.support import (
    app_registry,
    pipeline_env,
    run_cli,
    running_worker,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.relay_app"
PROCESSES = 2


def workers(env: dict[str, str]) -> list[dict]:
    ran = run_cli(["status", "--json"], env)
    assert ran.returncode in (0, 1), ran.stderr
    return json.loads(ran.stdout)["workers"]


def states(env: dict[str, str]) -> list[str]:
    return sorted(row["state"] for row in workers(env))


def doctor_findings(env: dict[str, str]) -> list[tuple[str, str]]:
    ran = run_cli(["doctor", "--json"], env)
    found = json.loads(ran.stdout)["findings"]
    return [(f["status"], f["summary"]) for f in found if f["check"] == "workers"]


def test_a_live_worker_is_alive_a_paused_one_stale_a_killed_one_gone(
    settings: Settings, engine, tmp_path
):
    quiet = settings.replace(canary_interval=0)
    env = pipeline_env(quiet, APP, PIPELINE_HEARTBEAT_STALE_SECONDS="5")
    assert workers(env) == []
    assert doctor_findings(env)[0][:1] == ("info",)
    worker = start_worker(
        quiet,
        APP,
        tmp_path / "worker.log",
        processes=PROCESSES,
        threads=1,
        PIPELINE_WORKER_METRICS_PORT="0",
    )
    try:
        wait_until(lambda: states(env) == ["idle"] * PROCESSES, timeout=60, alive=[worker])
        rows = workers(env)
        assert len({row["pid"] for row in rows}) == PROCESSES
        assert worker.pid not in {row["pid"] for row in rows}  # Dramatiq's processes, each
        assert run_cli(["status"], env).returncode == 0
        assert doctor_findings(env) == [("ok", f"{PROCESSES} worker(s) alive (0 busy, 2 idle)")]

        os.killpg(worker.pid, signal.SIGSTOP)
        wait_until(lambda: states(env) == ["stale"] * PROCESSES, timeout=30)
        ran = run_cli(["status"], env)
        assert ran.returncode == 1
        stale_lines = [line for line in ran.stdout.splitlines() if "problem: worker" in line]
        assert len(stale_lines) == PROCESSES, ran.stdout
        assert "workers (0 alive):" in ran.stdout
        assert [s for s, _ in doctor_findings(env)] == ["problem"] * PROCESSES

        os.killpg(worker.pid, signal.SIGCONT)
        wait_until(lambda: states(env) == ["idle"] * PROCESSES, timeout=30, alive=[worker])

        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        wait_until(lambda: states(env) == ["gone"] * PROCESSES, timeout=10)
        assert run_cli(["status"], env).returncode == 0  # gone rows are listed, not problems
        ((status, summary),) = doctor_findings(env)
        assert status == "info" and f"{PROCESSES} gone" in summary
    finally:
        stop_process(worker)
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM pipeline.worker_state")


def test_a_worker_that_stops_cleanly_removes_its_rows(settings: Settings, engine):
    """The heartbeat middleware on Dramatiq's worker in this process: its row is there
    while the worker runs, gone once it has stopped (what a SIGTERM does to a real
    ``pipeline worker``, checked in the observability tests)."""
    quiet = settings.replace(canary_interval=0)
    env = pipeline_env(quiet, APP)
    runtime = build_runtime(quiet, app_registry(APP), set_global_broker=False)
    runtime.broker.add_middleware(WorkerHeartbeat(quiet))
    try:
        with running_worker(runtime, threads=1):
            wait_until(lambda: states(env) == ["idle"], timeout=60)
        assert workers(env) == []
    finally:
        runtime.close()
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM pipeline.worker_state")
