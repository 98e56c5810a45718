"""The drill across hosts (``pipeline drill --hosts``): where each process runs, and the
network faults between them.

Postgres, the broker (Redis, or with ``--transport amqp`` every RabbitMQ node), every
relay, every worker group and the producers (with the payment API and the drill's own
checks) each run on a host of their own
(:class:`~pipeline.tools.harness.hosts.HostNetwork`: network namespaces on one bridge, on
this machine). The processes then reach the servers at the hosts' addresses, with no
proxy between them, and the drill cuts links instead:

* ``partition-worker-broker`` / ``-postgres`` / ``-both``: a worker group's host loses
  the broker, Postgres or both, for a while, silently (packets vanish; nobody is told);
* ``partition-relay-postgres`` / ``partition-relay-broker``: a relay's host loses
  Postgres (while it holds claims) or the broker (mid-publish);
* ``zombie-relay``: a relay is paused (``SIGSTOP``) past its lease while its host is cut
  from Postgres; the link heals and then the relay resumes, to find its claims taken over;
* ``link-degrade``: delay and loss on a worker host's link: ``tc netem`` where the kernel
  has netem. Otherwise a token bucket (``tc tbf``) on both ends of the host's link, slow
  enough that its traffic queues (delay) and overflows the queue (tail drops), and, where
  ``nft`` works, netem's random loss too: an nftables filter at each end of the link
  dropping each arriving packet with netem's probability (both ways). Without ``nft``, the
  bucket alone (its tail drops are the only loss).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.tools.drill.members import Member, Members
from pipeline.tools.harness.hosts import Host, HostNetwork, HostNetworkUnavailable

PARTITIONS = {
    "partition-worker-broker": ("worker", ("broker",)),
    "partition-worker-postgres": ("worker", ("pg",)),
    "partition-worker-both": ("worker", ("broker", "pg")),
    "partition-relay-postgres": ("relay", ("pg",)),
    "partition-relay-broker": ("relay", ("broker",)),
}
NETWORK_KINDS = (*PARTITIONS, "zombie-relay", "link-degrade")
NETWORK_DESCRIPTIONS = {
    "partition-worker-broker": "a worker group's host cut from the broker (silently) for a while",
    "partition-worker-postgres": "a worker group's host cut from Postgres for a while",
    "partition-worker-both": "a worker group's host cut from the broker and Postgres for a while",
    "partition-relay-postgres": "a relay's host cut from Postgres while it holds claims",
    "partition-relay-broker": "a relay's host cut from the broker mid-publish",
    "zombie-relay": "a relay paused past its lease while cut from Postgres; heals, then resumes",
    "link-degrade": "delay 50 ms +- 20 ms and 5 % loss on a worker host's link (tc netem); "
    "without netem, the link both ways through a 128 kbit/s token bucket (tc tbf: queueing "
    "delay and tail drops) and 5 % random loss each way (nftables), or the bucket alone "
    "without nft",
}
PROXY_KINDS = ("proxy-drop", "proxy-stall")
"""Faults of the proxies, which do not run across hosts (partitions stand in for them)."""
DEGRADE = (50.0, 20.0, 5.0)  # delay ms, jitter ms, loss %
THROTTLE = (128, 4096, 100)  # rate kbit/s, burst bytes, queue ms: where netem is missing
APP_HOST = "app"


def host_of(member_name: str) -> str:
    """The host a relay or worker runs on: ``relay-2`` on ``relay2``, ``worker-1`` on ``work1``."""
    kind, _, number = member_name.partition("-")
    return f"{'relay' if kind == 'relay' else 'work'}{number}"


@dataclass
class DrillHosts:
    """The drill's hosts: ``pg``, ``broker``, ``app``, ``relayN`` and ``workN``."""

    network: HostNetwork
    link_emulation: str | None = None
    """What ``link-degrade`` uses here, ``"netem"``, ``"tbf+nft-loss"`` (a token bucket and
    random loss by nftables) or ``"tbf"`` (the bucket alone): see :meth:`link_problem`."""
    loss_problem: str | None = None
    """Why there is no random loss with the token bucket (``"tbf"``), or None."""

    @classmethod
    def create(cls, relays: int, workers: int) -> DrillHosts:
        names = [
            "pg",
            "broker",
            APP_HOST,
            *(host_of(f"relay-{n}") for n in range(1, relays + 1)),
            *(host_of(f"worker-{n}") for n in range(1, workers + 1)),
        ]
        return cls(HostNetwork(names).create())

    def __getitem__(self, name: str) -> Host:
        return self.network[name]

    def of(self, member: Member) -> Host:
        return self.network[host_of(member.name)]

    def link_problem(self) -> str | None:
        """Why ``link-degrade`` cannot be done here (this kernel's ``tc`` has neither netem nor
        tbf), or None, with :attr:`link_emulation` set to what works (tried on the app host,
        then removed): netem; else tbf with nftables' random loss; else tbf alone."""
        try:
            self.network.degrade(APP_HOST, *DEGRADE)
        except HostNetworkUnavailable as no_netem:
            try:
                self.network.throttle(APP_HOST, *THROTTLE)
            except HostNetworkUnavailable as no_tbf:
                return f"{no_netem}; {no_tbf}"
            try:
                self.network.lose(APP_HOST, DEGRADE[2])
            except HostNetworkUnavailable as no_nft:
                self.link_emulation = "tbf"
                self.loss_problem = str(no_nft)
            else:
                self.link_emulation = "tbf+nft-loss"
        else:
            self.link_emulation = "netem"
        self.network.restore(APP_HOST)
        return None

    def layout(self) -> str:
        return ", ".join(f"{h.name} {h.address}" for h in self.network.hosts.values())

    def close(self) -> None:
        self.network.close()


@dataclass
class NetworkFaults:
    """Does the network fault kinds (on the drill's main thread, one after another)."""

    hosts: DrillHosts
    members: Members
    rng: random.Random
    wait: Callable[[float], None]

    def do(self, kind: str, seconds: float) -> tuple[str, str]:
        """Inject ``kind`` for ``seconds``; returns (target, detail)."""
        network = self.hosts.network
        if kind in PARTITIONS:
            role, servers = PARTITIONS[kind]
            member = self.rng.choice(self.members.of("relay" if role == "relay" else "worker"))
            host = host_of(member.name)
            cuts = [(host, server) for server in servers]
            try:
                for cut in cuts:
                    network.partition(*cut)
                self.wait(seconds)
            finally:
                for cut in cuts:
                    network.heal(*cut)
            return member.name, f"{host} cut from {' and '.join(servers)} for {seconds:.1f} s"
        if kind == "zombie-relay":
            member = self.rng.choice(self.members.of("relay"))
            return member.name, self._zombie(member, seconds)
        if kind == "link-degrade":
            member = self.rng.choice(self.members.of("worker"))
            return member.name, self._degrade(host_of(member.name), seconds)
        raise ValueError(f"unknown network fault kind {kind!r}")

    def _degrade(self, host: str, seconds: float) -> str:
        """Delay and loss on ``host``'s link for ``seconds``: netem, or else a token bucket
        with (where nftables works) random loss."""
        network = self.hosts.network
        emulation = self.hosts.link_emulation
        delay, jitter, loss = DEGRADE
        try:
            if emulation == "netem":
                network.degrade(host, *DEGRADE)
            else:
                network.throttle(host, *THROTTLE)
                if emulation == "tbf+nft-loss":
                    network.lose(host, loss)
            self.wait(seconds)
            dropped, delayed = network.shaped(host) if emulation != "netem" else (0, 0)
            lost = network.lost(host) if emulation == "tbf+nft-loss" else 0
        finally:
            network.restore(host)
        if emulation == "netem":
            return (
                f"{host}: {delay:g} ms +- {jitter:g} ms, {loss:g} % loss (tc netem) "
                f"for {seconds:.1f} s"
            )
        rate, burst, queue = THROTTLE
        bucket = (
            f"{host}: both ways through a token bucket (tc tbf, no netem here) of "
            f"{rate} kbit/s, burst {burst} B, queue {queue} ms"
        )
        if emulation == "tbf+nft-loss":
            return (
                f"{bucket}, and {loss:g} % random loss each way (nftables) for "
                f"{seconds:.1f} s: over the rate {delayed} times, {dropped} packets dropped "
                f"by the bucket, {lost} at random"
            )
        return (
            f"{bucket} for {seconds:.1f} s: over the rate {delayed} times, "
            f"{dropped} packets dropped"
        )

    def _zombie(self, member: Member, seconds: float) -> str:
        """Pause the relay, cut it from Postgres, heal, then let it run again."""
        if member.child is None or not member.child.running():
            return f"{member.name} was not running"
        pid = member.child.pid
        host = host_of(member.name)
        os.kill(pid, signal.SIGSTOP)
        try:
            self.hosts.network.partition(host, "pg")
            try:
                self.wait(seconds)
            finally:
                self.hosts.network.heal(host, "pg")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return f"{member.name} paused {seconds:.1f} s (cut from Postgres), healed, then resumed"
