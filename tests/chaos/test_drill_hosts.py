"""``pipeline drill --hosts``, shortened: every process on a host of its own (network
namespaces), and the network fault kinds between them. Needs root; skipped otherwise."""

from __future__ import annotations

import shutil

import pytest

from pipeline.tools.drill.network import NETWORK_KINDS
from pipeline.tools.drill.report import render_text
from pipeline.tools.harness.hosts import host_network_problem
from tests.chaos.test_drill import (
    assert_every_kind_injected,
    assert_orders_flowed_through_every_fault,
    drill,
)
from tests.chaos.test_drill_amqp import assert_majority_guarded, require_rabbitmq
from tests.support import SOAK

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(600)
def test_across_hosts_every_network_fault_keeps_every_guarantee():
    """Relays, worker groups, Postgres, Redis and the producer on hosts of their own; each
    network fault kind cuts or degrades links between them (3 s each here) while orders
    flow. The seed spreads the seven faults over the 30 s window. ``link-degrade`` is netem
    where the kernel has it, else a token bucket with nftables' random loss (the bucket
    alone without ``nft``); its detail says which ran."""
    problem = host_network_problem()
    if problem is not None:
        pytest.skip(problem)
    kinds = NETWORK_KINDS
    fleet = () if SOAK else ("--workers", "1")  # as the shortened drill: one worker group
    result, report = drill(
        "--hosts", "--events", "300", "--rate", "10", "--faults", str(len(kinds)),
        "--fault-kinds", ",".join(kinds), "--network-seconds", "3",
        "--seed", "280", "--recovery-timeout", "90", *fleet,
    )  # fmt: skip

    assert_every_kind_injected(report, kinds)
    assert_orders_flowed_through_every_fault(report)
    assert "each on a host of its own" in report["setup"]["processes"]
    assert report["violations"] == [], render_text(report)
    assert report["api"]["charges"]["total"] == 300
    assert report["dead_letters"] == {"expected": 6, "found": 6, "unexpected": 0}
    [degrade] = [f for f in report["faults"]["timeline"] if f["kind"] == "link-degrade"]
    assert "(tc netem)" in degrade["detail"] or "(tc tbf, no netem here)" in degrade["detail"]
    if "(tc tbf, no netem here)" in degrade["detail"] and shutil.which("nft") is not None:
        assert "random loss each way (nftables)" in degrade["detail"]
    assert result.returncode == 0


@pytest.mark.soak
@pytest.mark.skipif(not SOAK, reason="about a minute; PIPELINE_SOAK=1 runs it")
@pytest.mark.timeout(600)
def test_across_hosts_a_sentinel_failover_and_a_partition_in_one_drill():
    """``--hosts --sentinel``: the master, replica and sentinels on the broker host, so a
    partition of a worker host and both failover kinds happen in the same run."""
    problem = host_network_problem()
    if problem is not None:
        pytest.skip(problem)
    kinds = ("partition-worker-broker", "sentinel-kill-master", "sentinel-failover")
    result, report = drill(
        "--hosts", "--sentinel", "--events", "300", "--rate", "40", "--faults", "3",
        "--fault-kinds", ",".join(kinds), "--network-seconds", "5",
        "--seed", "5", "--recovery-timeout", "120",
    )  # fmt: skip

    assert_every_kind_injected(report, kinds)
    assert "on the broker host" in report["setup"]["redis"]
    assert report["violations"] == [], render_text(report)
    assert report["api"]["charges"]["total"] == 300
    assert result.returncode == 0


@pytest.mark.soak
@pytest.mark.skipif(not SOAK, reason="a few minutes; PIPELINE_SOAK=1 runs it")
@pytest.mark.timeout(900)
def test_across_hosts_on_rabbitmq_partitions_and_node_faults_in_one_drill():
    """``--hosts --transport amqp``: three RabbitMQ nodes on the broker host, reached at its
    address. A worker's and a relay's host are cut from them, one node is killed and two
    of three are (no majority: nothing may be marked sent), while orders flow."""
    problem = host_network_problem()
    if problem is not None:
        pytest.skip(problem)
    require_rabbitmq()
    kinds = (
        "partition-worker-broker", "partition-relay-broker", "rabbit-kill-node",
        "rabbit-no-majority",
    )  # fmt: skip
    result, report = drill(
        "--hosts", "--transport", "amqp", "--events", "400", "--rate", "5",
        "--faults", str(len(kinds)), "--fault-kinds", ",".join(kinds),
        "--network-seconds", "5", "--seed", "11", "--recovery-timeout", "180",
    )  # fmt: skip

    assert_every_kind_injected(report, kinds)
    assert_majority_guarded(report)
    assert "on the broker host" in report["setup"]["rabbitmq"]
    assert "each on a host of its own" in report["setup"]["processes"]
    partitions = [f for f in report["faults"]["timeline"] if f["kind"].startswith("partition")]
    assert all("cut from broker" in f["detail"] for f in partitions), partitions
    assert report["violations"] == [], render_text(report)
    assert report["api"]["charges"]["total"] == 400
    assert result.returncode == 0
