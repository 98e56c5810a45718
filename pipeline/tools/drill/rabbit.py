"""The drill on RabbitMQ (``pipeline drill --transport amqp``): its own cluster and its faults.

The drill starts a throwaway cluster of its own (:class:`RabbitCluster`: one or three
nodes of Debian's ``rabbitmq-server`` on this machine, with their own names, ports and
data directories; the machine's own RabbitMQ is never touched; with ``--hosts`` all on
the broker host, reached at its address) and does to it:

* ``rabbit-kill-node``: SIGKILL of one node while orders flow, started again a few
  seconds later; the first one hits the leader of the busiest of the drill's queues, so a
  new leader must be elected under load;
* ``rabbit-restart-node``: a node stopped cleanly and started again;
* ``rabbit-no-majority``: two nodes of three killed at once. The quorum queues then have
  no majority, so no publish can be confirmed: the relays must mark nothing sent while it
  lasts (checked: the count of sent events after a short grace and at the window's end
  must be equal, else the fault records a violation). One node then returns, and the
  flow must resume (bounded wait), before the other returns too;
* ``rabbit-stall``: every worker <-> broker connection stalled through the drill's
  proxies (nothing closed, nothing answered) for a while; not with ``--hosts``, which has
  no proxies (``partition-worker-broker`` cuts those connections there).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ServiceUnavailableError
from pipeline.tools.harness.hosts import Host
from pipeline.tools.harness.rabbitmq_cluster import RabbitCluster
from pipeline.transport.amqp.broker import is_dead_letter_queue, physical_name
from pipeline.transport.amqp.management import Management

RABBIT_KINDS = ("rabbit-kill-node", "rabbit-restart-node", "rabbit-no-majority", "rabbit-stall")
RABBIT_DESCRIPTIONS = {
    "rabbit-kill-node": "SIGKILL of one RabbitMQ node (the first time the leader of the busiest "
    "queue), started again after 2-6 s",
    "rabbit-restart-node": "one RabbitMQ node stopped cleanly and started again",
    "rabbit-no-majority": "two of three RabbitMQ nodes killed at once for 5-15 s: nothing may be "
    "marked sent; one returns and the flow must resume, then the other",
    "rabbit-stall": "every worker <-> RabbitMQ connection stalled 3-12 s through the proxies",
}
MAJORITY_GRACE_SECONDS = 3.0  # a batch confirmed just before the loss may still be marking
RESUME_TIMEOUT = 180.0
CONNECTED_TIMEOUT = 30.0  # a stall waits this long for the workers to be connected


def rabbit_seconds(kind: str, rng: random.Random) -> float:
    """How long a RabbitMQ fault lasts (down time, window without majority, stall)."""
    if kind == "rabbit-kill-node":
        return rng.uniform(2.0, 6.0)
    if kind == "rabbit-no-majority":
        return rng.uniform(5.0, 15.0)
    if kind == "rabbit-stall":
        return rng.uniform(3.0, 12.0)
    return 0.0


class OwnedRabbit:
    """The drill's own RabbitMQ cluster, its data under ``directory`` (kept with the logs),
    on ``host`` when given."""

    def __init__(self, nodes: int, directory: Path, host: Host | None = None) -> None:
        self.cluster = RabbitCluster(nodes, base_dir=directory, host=host)

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def management_url(self) -> str:
        return self.cluster.nodes[0].management_url

    def node_urls(self) -> list[str]:
        return [node.url for node in self.cluster.nodes]

    def start(self) -> None:
        self.cluster.start()

    def close(self) -> None:
        self.cluster.cleanup()


@dataclass
class RabbitFaults:
    """Does the ``rabbit-*`` faults on the drill's cluster (on the drill's main thread)."""

    rabbit: OwnedRabbit
    namespace: str
    rng: random.Random
    sent: Callable[[], int]  # events marked sent so far (the drill's database)
    stall: Callable[[float], str]  # stall every worker <-> broker proxy for that long
    connections: Callable[[], int]  # worker <-> broker connections open through the proxies
    wait: Callable[[float], None]
    leader_killed: bool = field(default=False)

    def do(self, fault: Any) -> str:
        kind = fault.kind
        if kind == "rabbit-kill-node":
            return self._kill_node(fault)
        if kind == "rabbit-restart-node":
            index = self.rng.choice(self._running())
            fault.target = self._name(index)
            began = time.monotonic()
            self.rabbit.cluster.stop(index)
            self.rabbit.cluster.restart(index)
            return f"node {index} stopped and started again, down {time.monotonic() - began:.1f} s"
        if kind == "rabbit-no-majority":
            return self._no_majority(fault)
        if kind == "rabbit-stall":
            fault.target = "worker <-> rabbitmq"
            deadline = time.monotonic() + CONNECTED_TIMEOUT
            while self.connections() == 0 and time.monotonic() < deadline:
                self.wait(0.5)  # after a node fault the workers may still be reconnecting
            answer = self.stall(fault.seconds)
            self.wait(fault.seconds)
            return f"{fault.seconds:.1f} s; {answer}"
        raise ValueError(f"unknown RabbitMQ fault kind {kind!r}")

    def _kill_node(self, fault: Any) -> str:
        chosen = ""
        index = None
        if not self.leader_killed:
            found = self.busiest_leader()
            if found is not None:
                index, queue = found
                chosen = f" (leader of {queue}, the busiest queue)"
                self.leader_killed = True
        if index is None:
            index = self.rng.choice(self._running())
        fault.target = self._name(index)
        began = time.monotonic()
        self.rabbit.cluster.kill(index)
        self.wait(fault.seconds)
        self.rabbit.cluster.restart(index)
        return (
            f"node {index}{chosen} killed, started again after {fault.seconds:.1f} s, "
            f"back after {time.monotonic() - began:.1f} s"
        )

    def _no_majority(self, fault: Any) -> str:
        """Two of three nodes down: nothing marked sent until a majority returns."""
        cluster = self.rabbit.cluster
        if cluster.size < 3:
            raise ValueError("rabbit-no-majority needs three nodes (--rabbit-nodes 3)")
        first, second = self.rng.sample([node.index for node in cluster.nodes], 2)
        fault.target = f"{self._name(first)}, {self._name(second)}"
        cluster.kill(first)
        cluster.kill(second)
        self.wait(MAJORITY_GRACE_SECONDS)
        before = self.sent()
        self.wait(fault.seconds)
        after = self.sent()
        if after != before:
            fault.violation = (
                f"{after - before} events marked sent while two of three RabbitMQ nodes "
                f"were down ({fault.seconds:.1f} s window)"
            )
        returned = time.monotonic()
        try:
            cluster.restart(first)
            back = time.monotonic() - returned
            deadline = time.monotonic() + RESUME_TIMEOUT
            resumed = None
            while time.monotonic() < deadline:
                if self.sent() > after:
                    resumed = time.monotonic() - returned
                    break
                self.wait(0.5)
        finally:  # whatever failed above, the rest of the run gets its third node back
            cluster.restart(second)
        if resumed is None:
            fault.violation = (
                f"nothing marked sent within {RESUME_TIMEOUT:g} s of a majority returning"
            )
        flow = f"flow resumed {resumed:.1f} s after" if resumed is not None else "no flow after"
        return (
            f"nodes {first} and {second} killed; {after - before} marked sent in "
            f"{fault.seconds:.1f} s without a majority; node {first} back in {back:.1f} s, "
            f"{flow} it was started; node {second} back"
        )

    def busiest_leader(self) -> tuple[int, str] | None:
        """The node leading the drill's busiest queue (the highest publish rate, then the
        most messages), as a running node's management API lists it; None when none answers."""
        prefix = physical_name(self.namespace, "")
        cluster = self.rabbit.cluster
        for node in cluster.nodes:
            if not node.running:
                continue
            try:
                listed = Management(node.url, node.management_url).queue_traffic()
            except ServiceUnavailableError:  # a node busy starting: ask the next
                continue
            ours = [
                q
                for q in listed
                if q["name"].startswith(prefix)
                and not is_dead_letter_queue(q["name"])  # dead letters pile up: not the flow
                and q.get("leader")
            ]
            if not ours:
                continue
            busiest = max(ours, key=_traffic)
            for candidate in cluster.nodes:
                if candidate.name == busiest["leader"] and candidate.running:
                    return candidate.index, busiest["name"]
        return None

    def _running(self) -> list[int]:
        return [node.index for node in self.rabbit.cluster.nodes if node.running] or [1]

    def _name(self, index: int) -> str:
        return f"rabbit-{index}"


def _traffic(queue: dict[str, Any]) -> tuple[float, int, str]:
    rate = queue.get("message_stats", {}).get("publish_details", {}).get("rate", 0.0)
    return float(rate or 0.0), int(queue.get("messages") or 0), queue["name"]
