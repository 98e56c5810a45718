"""Heartbeats that tell the truth, with a real relay process.

An idle relay refreshes its heartbeat (so ``pipeline status`` and ``doctor`` show it
alive and idle however long it has had nothing to do); a relay killed with ``kill -9``
leaves its row behind and is shown gone, not idle; a relay whose heartbeat stopped a while
ago is stale (a problem) and after longer gone.
"""

from __future__ import annotations

import json
import signal

from pipeline import Settings
from tests.support import pipeline_env, run_cli, start_relay, stop_process, wait_until

APP = "tests.apps.relay_app"


def relays(env: dict[str, str]) -> list[dict]:
    ran = run_cli(["status", "--json"], env)
    assert ran.returncode in (0, 1), ran.stderr
    return json.loads(ran.stdout)["relays"]


def test_an_idle_relay_stays_alive_and_a_killed_one_is_gone(settings: Settings, engine, tmp_path):
    idle = settings.replace(canary_interval=0, poll_interval_max=10.0)
    env = pipeline_env(idle, APP, PIPELINE_HEARTBEAT_STALE_SECONDS="5")
    log = tmp_path / "relay.log"
    relay = start_relay(idle, APP, log, "--metrics-port", "0")
    try:
        rows = wait_until(lambda: relays(env), timeout=60, alive=[relay])
        assert [row["pid"] for row in rows] == [relay.pid]
        assert rows[0]["state"] == "idle"

        def heartbeat_at() -> float:
            with engine.connect() as conn:
                return conn.exec_driver_sql(
                    "SELECT extract(epoch FROM heartbeat_at) FROM pipeline.relay_state"
                ).scalar_one()

        # Idle (no events, no canary, polls 10 s apart), the heartbeat still advances.
        seen = [heartbeat_at()]
        for _ in range(3):
            seen.append(wait_until(lambda: (t := heartbeat_at()) > seen[-1] and t, timeout=30))
        assert relays(env)[0]["state"] == "idle"
        doctor = run_cli(["doctor", "--json"], env)
        found = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "relays"]
        assert [(f["status"], f["summary"]) for f in found] == [
            ("ok", "1 relay(s) alive (0 busy, 1 idle)")
        ]
        assert run_cli(["status"], env).returncode == 0

        # Paused (a frozen host, a stuck process): its heartbeat stops, it is stale, a problem.
        relay.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: relays(env)[0]["state"] == "stale", timeout=30)
            ran = run_cli(["status"], env)
            assert ran.returncode == 1
            assert f"problem: relay {rows[0]['relay_id']} " in ran.stdout, ran.stdout
            assert "relays (0 alive):" in ran.stdout
            doctor = run_cli(["doctor", "--json"], env)
            found = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "relays"]
            assert [f["status"] for f in found] == ["problem"]
        finally:
            relay.send_signal(signal.SIGCONT)
        wait_until(lambda: relays(env)[0]["state"] == "idle", timeout=30, alive=[relay])

        relay.send_signal(signal.SIGKILL)
        relay.wait(timeout=10)
        rows = relays(env)
        assert [(row["pid"], row["state"]) for row in rows] == [(relay.pid, "gone")]
        ran = run_cli(["status"], env)
        assert f"pid {relay.pid}): gone" in ran.stdout
        assert "relays (0 alive):" in ran.stdout
        doctor = run_cli(["doctor", "--json"], env)
        found = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "relays"]
        assert [f["status"] for f in found] == ["info"]
        assert "1 gone" in found[0]["summary"]
    finally:
        stop_process(relay)
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM pipeline.relay_state")
