"""The harness's fleet and readiness waits, with real processes.

The fleet's promise is that nothing it started outlives its owner, grandchildren
included, however the owner ends; the readiness wait's is that a slow but moving child
is waited for, and a dead or frozen one is given up on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

from pipeline.config import Settings
from pipeline.tools.harness.fleet import Fleet
from pipeline.tools.harness.processes import pid_alive
from pipeline.tools.harness.readiness import wait_ready
from pipeline.tools.harness.sql import WorkflowQueries

# A child that starts a grandchild in the same process group and reports both pids.
PARENT_OF_SLEEPER = (
    "import subprocess, sys, time\n"
    "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(grandchild.pid, flush=True)\n"
    "time.sleep(600)\n"
)

# An owner that starts such a child through a fleet, prints the pids, then waits to die.
OWNER = """
import json, subprocess, sys, time
from pathlib import Path
from pipeline.tools.harness.fleet import Fleet

fleet = Fleet()
fleet.open()
log = Path(sys.argv[1])
fleet.remove_on_death(log.parent)
child = fleet.start("sleeper", [sys.executable, "-c", sys.argv[2]], log_path=log)
while not log.read_text().strip():
    time.sleep(0.05)
print(json.dumps({"child": child.pid, "grandchild": int(log.read_text().split()[0]),
                  "watchdog": fleet.watchdog_pid}), flush=True)
time.sleep(600)
"""


def _gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if pid_alive(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if pid_alive(pid)]


def test_a_killed_owner_takes_children_and_grandchildren_with_it(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(work / "sleeper.log"), PARENT_OF_SLEEPER],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        started = json.loads(owner.stdout.readline())
        pids = [started["child"], started["grandchild"]]
        assert all(pid_alive(pid) for pid in pids)
        owner.kill()  # SIGKILL: none of the owner's own code runs
        owner.wait(timeout=30)
        assert _gone([*pids, started["watchdog"]], timeout=30) == []
        assert not work.exists()  # what the owner asked to delete on death
    finally:
        owner.kill()
        owner.wait()


def test_stop_ends_children_and_the_watchdog_has_nothing_left(tmp_path: Path) -> None:
    fleet = Fleet()
    child = fleet.start(
        "sleeper", [sys.executable, "-c", PARENT_OF_SLEEPER], log_path=tmp_path / "log"
    )
    watchdog = fleet.watchdog_pid
    assert watchdog is not None
    wait_ready(
        lambda: bool((tmp_path / "log").read_text().strip()),
        [child],
        died=lambda c: AssertionError(f"{c.name} died"),
        stalled=AssertionError,
    )
    grandchild = int((tmp_path / "log").read_text().split()[0])
    fleet.stop(grace=5.0)
    fleet.close()
    assert _gone([child.pid, grandchild, watchdog], timeout=30) == []
    assert fleet.children == []


def test_a_slow_child_that_keeps_moving_is_waited_for_past_the_stall_limit(
    tmp_path: Path,
) -> None:
    """Busy for three stall periods (CPU and log), then ready: the wait must not give up."""
    busy = (
        "import sys, time\n"
        "end = time.monotonic() + 3.5\n"
        "while time.monotonic() < end:\n"
        "    print('starting', flush=True); time.sleep(0.2)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    fleet = Fleet()
    try:
        child = fleet.start("slow", [sys.executable, "-c", busy], log_path=tmp_path / "log")
        waited = wait_ready(
            lambda: child.count_in_log("ready") > 0,
            [child],
            died=lambda c: AssertionError("died"),
            stalled=AssertionError,
            stall_seconds=1.2,
        )
        assert waited > 3.0
    finally:
        fleet.close()


def test_a_frozen_child_is_given_up_on_and_a_dead_one_at_once(tmp_path: Path) -> None:
    fleet = Fleet()
    try:
        frozen = fleet.start("frozen", [sys.executable, "-c", "import time; time.sleep(600)"])
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="nothing moved"):
            wait_ready(
                lambda: False,
                [frozen],
                died=lambda c: AssertionError("died"),
                stalled=TimeoutError,
                stall_seconds=1.5,
            )
        assert 1.5 <= time.monotonic() - began < 30

        dead = fleet.start(
            "dead", [sys.executable, "-c", "print('bad setting'); raise SystemExit(3)"],
            log_path=tmp_path / "dead.log",
        )  # fmt: skip
        with pytest.raises(RuntimeError, match="dead exited 3: bad setting"):
            wait_ready(
                lambda: False,
                [dead],
                died=lambda c: RuntimeError(f"{c.name} exited {c.returncode}: {c.log_tail()}"),
                stalled=AssertionError,
            )
    finally:
        fleet.close()


def test_a_moving_child_that_never_gets_ready_meets_the_ceiling(tmp_path: Path) -> None:
    spinner = "import time\nwhile True:\n    print('still starting', flush=True); time.sleep(0.1)\n"
    fleet = Fleet()
    try:
        child = fleet.start("spinner", [sys.executable, "-c", spinner], log_path=tmp_path / "log")
        with pytest.raises(TimeoutError, match="not ready after"):
            wait_ready(
                lambda: False,
                [child],
                died=AssertionError,
                stalled=TimeoutError,
                stall_seconds=1.0,
                ceiling=3.0,
            )
    finally:
        fleet.close()


def test_only_relays_with_a_fresh_heartbeat_count_as_registered(
    engine: Engine, settings: Settings
) -> None:
    """A live relay refreshes its heartbeat every couple of seconds, idle or busy, so a
    readiness check counts relays whose heartbeat is fresh: a row left by a relay killed
    with ``kill -9`` (its heartbeat stopped) does not make a run look ready."""
    queries = WorkflowQueries(settings.schema_name, "unused")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {settings.schema_name}.relay_state (relay_id, busy, heartbeat_at, host,"
            " pid) VALUES ('idle', false, clock_timestamp(), 'here', 4242),"
            " ('killed', false, clock_timestamp() - interval '1 hour', 'here', 4244)"
        )
        count = lambda pids: conn.exec_driver_sql(  # noqa: E731
            queries.text("relays_registered"),
            {"pids": pids, "stale": settings.heartbeat_stale_seconds},
        ).scalar_one()
        assert count([4242]) == 1
        assert count([4243]) == 0  # another run's relay is not ours
        assert count([4244]) == 0  # its heartbeat stopped an hour ago: stale or gone
        assert count(None) == 1  # --external: any live relay
