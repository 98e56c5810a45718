"""``pipeline drill``, shortened: real servers, relays, workers and every fault kind (minutes).

The drill is run as an operator runs it, and its JSON report is the evidence: every
guarantee it checks must hold, and every fault kind must really have been injected.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any

import psycopg
import pytest
import redis

from pipeline.tools.drill.faults import ONE_HOST_KINDS, STAGING_KINDS
from pipeline.tools.drill.report import render_text
from tests.support import SOAK, cli_argv

pytestmark = pytest.mark.chaos


def drill(
    *args: str, timeout: float = 900, **settings: str
) -> tuple[subprocess.CompletedProcess[str], Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env.update(settings)
    result = subprocess.run(
        cli_argv("drill", "--json", *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    try:
        report = json.loads(result.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {result.returncode}): {result.stderr[-3000:]}")
    return result, report


def assert_every_kind_injected(report: dict[str, Any], kinds: tuple[str, ...]) -> None:
    assert set(report["faults"]["by_kind"]) == set(kinds)
    failed = [f for f in report["faults"]["timeline"] if "could not be done" in f["detail"]]
    assert failed == []


def assert_orders_flowed_through_every_fault(report: dict[str, Any]) -> None:
    """Each fault began and ended before the last order was placed: traffic met every one.

    Faults fall due by the share of orders placed and run one after another, so a window
    shorter than their summed durations would leave the last ones hitting an idle pipeline.
    """
    production = report["production_seconds"] + 0.05  # the report rounds it to 0.1 s
    for fault in report["faults"]["timeline"]:
        ended = fault["at"] + fault["ended"] - fault["started"]
        assert fault["at"] < production and ended <= production, (fault, production)


@pytest.mark.timeout(900)
def test_shortened_drill_with_every_fault_kind_keeps_every_guarantee():
    # Few orders, but a production window (900 / 15 per s = 60 s) longer than the faults
    # take one after another (about 45 s: a relay pause past the 5 s lease and a worker
    # pause past a 5 s heartbeat timeout included), so orders flow through every one. The
    # seed puts the clock-skew stretch (which holds the count the faults wait on, and whose
    # shifted clock here runs behind) after the others.
    # One worker in the default run: a third less CPU, and the faults still meet a fleet
    # (two relays sharing the outbox); PIPELINE_SOAK=1 runs the drill's own two.
    fleet = () if SOAK else ("--workers", "1")
    result, report = drill(
        "--events", "900", "--faults", str(len(ONE_HOST_KINDS)), "--rate", "15",
        "--seed", "2340", "--recovery-timeout", "90", *fleet,
        PIPELINE_BROKER_HEARTBEAT_TIMEOUT_MS="5000",
    )  # fmt: skip

    assert_every_kind_injected(report, ONE_HOST_KINDS)
    assert_orders_flowed_through_every_fault(report)
    assert report["events"]["orders"] == 900 and report["events"]["poison"] == 3
    assert report["violations"] == [], render_text(report)
    assert report["api"]["charges"]["total"] == 900
    assert report["api"]["emails"]["total"] == 900
    assert report["dead_letters"] == {"expected": 6, "found": 6, "unexpected": 0}
    assert report["events"]["ids_out_of_sequence_order"]["events"] > 0  # the skew took hold
    assert result.returncode == 0


@pytest.mark.timeout(300)
@pytest.mark.skipif(not SOAK, reason="a drill on Sentinel (about 90 s); PIPELINE_SOAK=1 runs it")
def test_drill_on_sentinel_fails_over_twice_and_reports_when_the_flow_came_back():
    """``--sentinel``: the master killed (the old one back as a replica) and a forced
    failover under orders; nothing lost or done twice, and each fault says when the relays
    marked events sent again on the new master (the flow back an operator waits for)."""
    kinds = ("sentinel-failover", "sentinel-kill-master")
    result, report = drill(
        "--sentinel", "--events", "200", "--rate", "20", "--faults", "2",
        "--fault-kinds", ",".join(kinds), "--seed", "3", "--recovery-timeout", "120",
    )  # fmt: skip

    assert_every_kind_injected(report, kinds)
    assert report["violations"] == [], render_text(report)
    assert report["api"]["charges"]["total"] == 200
    for fault in report["faults"]["timeline"]:
        assert re.search(r"events marked sent again \d+\.\d s after it began", fault["detail"]), (
            fault
        )
    assert result.returncode == 0


def test_network_faults_need_hosts_and_proxy_faults_refuse_them():
    for args, line in (
        (
            ["--fault-kinds", "partition-worker-broker"],
            "fault kind 'partition-worker-broker' cuts links between hosts: run with --hosts",
        ),
        (
            ["--hosts", "--fault-kinds", "proxy-drop"],
            "fault kind 'proxy-drop' acts through the proxies, which do not run across hosts",
        ),
        (
            ["--hosts", "--redis-url", "redis://127.0.0.1:1/0"],
            "--hosts puts the drill's own Postgres and broker on hosts of their own: "
            "drop --database-url/--redis-url",
        ),
    ):
        result = subprocess.run(
            cli_argv("drill", *args),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 1
        assert result.stderr.strip().splitlines() == [f"pipeline: error: {line}"]


@pytest.mark.skipif(
    not SOAK, reason="a second full drill (about a minute); PIPELINE_SOAK=1 runs it"
)
@pytest.mark.timeout(600)
def test_staging_mode_never_touches_what_it_did_not_create(
    postgres_server_url: str, redis_server_url: str
):
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        schemas_before = {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace")}
    result, report = drill(
        "--database-url", postgres_server_url, "--redis-url", redis_server_url,
        "--events", "300", "--faults", str(len(STAGING_KINDS)), "--rate", "50",
        "--seed", "5", "--recovery-timeout", "60", "--relays", "1", "--workers", "1",
    )  # fmt: skip

    assert_every_kind_injected(report, STAGING_KINDS)
    assert "never restarted" in report["setup"]["postgres"]
    assert "never restarted" in report["setup"]["redis"]
    schema = f"drill_{report['run']}"
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        schemas_after = {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace")}
    assert schema not in schemas_after and f"{schema}_app" not in schemas_after
    assert schemas_before - schemas_after == set()  # nothing of anyone else's dropped
    client = redis.Redis.from_url(redis_server_url)
    try:
        assert list(client.scan_iter(match=f"{schema}:*", count=1000)) == []
    finally:
        client.close()
    assert report["violations"] == [], render_text(report)
    assert result.returncode == 0


def test_a_server_fault_against_a_given_server_is_refused_in_one_line():
    result = subprocess.run(
        cli_argv(
            "drill",
            "--database-url",
            "postgresql://nobody@127.0.0.1:1/none",
            "--fault-kinds",
            "worker-kill,postgres-restart-immediate",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "pipeline: error: fault kind 'postgres-restart-immediate' restarts a server, which the "
        "drill does only to servers it starts itself (drop --database-url/--redis-url for it)"
    ]
