"""``pipeline drill --transport amqp``: the drill on a RabbitMQ cluster of its own.

The drill starts three nodes of Debian's rabbitmq-server (the machine's own RabbitMQ is
never touched), runs orders through real relays and workers while it kills, stops and
isolates nodes and stalls the workers' broker connections, and its JSON report is the
evidence. The tests skip in one line where rabbitmq-server is not installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from pipeline.errors import BinaryNotFoundError
from pipeline.tools.drill.faults import AMQP_KINDS
from pipeline.tools.drill.rabbit import RABBIT_KINDS
from pipeline.tools.drill.report import render_text
from pipeline.tools.harness.rabbitmq_cluster import find_rabbitmq_bin
from tests.chaos.test_drill import (
    assert_every_kind_injected,
    assert_orders_flowed_through_every_fault,
    drill,
)
from tests.support import SOAK

pytestmark = pytest.mark.chaos


def require_rabbitmq() -> None:
    try:
        find_rabbitmq_bin()
    except BinaryNotFoundError as exc:
        pytest.skip(f"no RabbitMQ for the drill: {exc}")


def assert_majority_guarded(report: dict[str, Any]) -> None:
    """Each window without a majority marked nothing sent, and the flow resumed after."""
    windows = [f for f in report["faults"]["timeline"] if f["kind"] == "rabbit-no-majority"]
    assert windows
    for fault in windows:
        assert " 0 marked sent in " in fault["detail"], fault
        assert "flow resumed" in fault["detail"], fault


@pytest.mark.timeout(600)
def test_drill_on_one_rabbitmq_node_survives_its_kill_and_a_stall() -> None:
    require_rabbitmq()
    # One node (a cluster of three takes minutes to start and restart here): a SIGKILL of
    # it mid-flow (the leader of every queue) and a stall of the workers' connections to it.
    result, report = drill(
        "--transport", "amqp", "--rabbit-nodes", "1", "--events", "100", "--rate", "5",
        "--faults", "2", "--fault-kinds", "rabbit-kill-node,rabbit-stall",
        "--seed", "26", "--recovery-timeout", "120", "--relays", "1", "--workers", "1",
    )  # fmt: skip

    assert_every_kind_injected(report, ("rabbit-kill-node", "rabbit-stall"))
    timeline = {f["kind"]: f for f in report["faults"]["timeline"]}
    assert "the busiest queue" in timeline["rabbit-kill-node"]["detail"]
    stalled = re.search(r"stalled (\d+)", timeline["rabbit-stall"]["detail"])
    assert stalled and int(stalled.group(1)) > 0, timeline["rabbit-stall"]  # workers were on it
    assert report["violations"] == [], render_text(report)
    assert report["events"]["orders"] == 100 and report["events"]["poison"] == 3
    assert report["api"]["charges"]["total"] == 100
    assert report["dead_letters"] == {"expected": 6, "found": 6, "unexpected": 0}
    assert "1 node(s)" in report["setup"]["rabbitmq"] and "redis" not in report["setup"]
    assert result.returncode == 0


@pytest.mark.skipif(
    not SOAK, reason="a three-node RabbitMQ drill (minutes); PIPELINE_SOAK=1 runs it"
)
@pytest.mark.timeout(900)
def test_drill_on_three_rabbitmq_nodes_survives_each_rabbitmq_fault() -> None:
    require_rabbitmq()
    # A few hundred orders over a window (360 / 6 per s = 60 s) about as long as the four
    # faults take one after another, with node restarts of 10-25 s on a busy machine.
    result, report = drill(
        "--transport", "amqp", "--events", "360", "--rate", "6",
        "--faults", str(len(RABBIT_KINDS)), "--fault-kinds", ",".join(RABBIT_KINDS),
        "--seed", "26", "--recovery-timeout", "180", "--relays", "1", "--workers", "1",
    )  # fmt: skip

    assert_every_kind_injected(report, RABBIT_KINDS)
    assert_majority_guarded(report)
    assert report["violations"] == [], render_text(report)
    assert report["api"]["charges"]["total"] == 360
    assert result.returncode == 0


@pytest.mark.skipif(
    not SOAK, reason="every fault kind on RabbitMQ (several minutes); PIPELINE_SOAK=1 runs it"
)
@pytest.mark.timeout(1800)
def test_drill_on_a_rabbitmq_cluster_with_every_allowed_kind() -> None:
    require_rabbitmq()
    # A window (2,000 / 5 per s = 400 s) well beyond what the 15 faults take one after
    # another here (160-260 s, node restarts included), so orders flow through every one.
    result, report = drill(
        "--transport", "amqp", "--events", "2000", "--rate", "5",
        "--faults", str(len(AMQP_KINDS)), "--seed", "2026", "--recovery-timeout", "300",
        PIPELINE_BROKER_HEARTBEAT_TIMEOUT_MS="5000",
    )  # fmt: skip

    assert_every_kind_injected(report, AMQP_KINDS)
    assert_orders_flowed_through_every_fault(report)
    assert_majority_guarded(report)
    assert report["violations"] == [], render_text(report)
    assert report["api"]["charges"]["total"] == report["events"]["orders"]
    assert result.returncode == 0


def test_a_redis_fault_is_refused_on_rabbitmq_in_one_line() -> None:
    # The other refusals (rabbit-* on Redis, no majority on one node, --hosts) are checked
    # on allowed_kinds in tests/unit/test_drill_plan.py.
    result = subprocess.run(
        [
            sys.executable, "-m", "pipeline.tools.cli", "drill",
            "--transport", "amqp", "--fault-kinds", "worker-kill,redis-down",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "pipeline: error: fault kind 'redis-down' acts on Redis, which --transport amqp "
        "replaces (use the rabbit-* kinds)"
    ]
