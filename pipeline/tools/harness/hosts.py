"""Hosts made of network namespaces on this machine, and the network faults between them.

The drill and the tests put Postgres, the broker, relays, workers and producers each on a
"host" of its own: a network namespace with one interface (``eth0``, a veth pair) on a
bridge that lives in a namespace of its own, so that every address exists only inside the
namespaces and no traffic leaves the machine. Between hosts the network can then fail the
way it does between machines:

* :meth:`HostNetwork.partition` cuts two hosts apart (each side's frames for the other go
  to a hardware address nobody has: packets vanish, connections hang until timeouts or
  keepalives end them, as in a real partition, rather than being refused);
* :meth:`HostNetwork.isolate` cuts a host from every other (its link on the bridge down);
* :meth:`HostNetwork.degrade` adds delay and loss on a host's link (``tc netem``, where
  the kernel has it; :class:`HostNetworkUnavailable` names what is missing otherwise);
* :meth:`HostNetwork.throttle` squeezes a host's link through a token bucket (``tc tbf``,
  both ends of its veth), for kernels without netem: packets past the bucket wait in a
  short queue (delay) and those past the queue are dropped (tail drops);
* :meth:`HostNetwork.lose` drops a random share of the packets on a host's link, both
  ways (``nft``: an ingress filter at each end of its veth, ``numgen random``), for
  kernels without netem: the random loss netem would add, to go with :meth:`throttle`;
* :meth:`HostNetwork.restore` removes all of them.

Processes are put on a host in one of two ways: a child process by the argv prefix of
:meth:`Host.command` (``ip netns exec``, then ``setpriv`` to drop root for servers that
refuse it), and code in this process by :meth:`Host.entered`, which moves the calling
*thread* into the namespace while its sockets are opened (a socket stays in the namespace
it was created in), as the drill's producer threads and checker do.

Root is required (``ip netns add``); :func:`host_network_problem` says, in one line, why
this machine cannot make hosts. Namespaces are named ``pl<owner pid>-<host>``; those of an
owner that died without cleaning up are deleted by the next :meth:`HostNetwork.create`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import ipaddress
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
SUBNET = ipaddress.ip_network("10.231.0.0/24")
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_OWNED = re.compile(r"^pl(\d+)-")
_QDISC_STATS = re.compile(r"dropped (\d+), overlimits (\d+)")
_NFT_DROPS = re.compile(r"counter packets (\d+) bytes \d+ drop")

NOWHERE = "02:00:5e:ff:ff:fe"  # a locally administered address no interface here has


def loss_table(name: str) -> str:
    """The nftables table (netdev family) of :meth:`HostNetwork.lose` for host ``name``
    (:data:`NAME_PATTERN`): one per host, so that the bridge's namespace, which holds every
    host's far end, never mixes two hosts' rules or counts."""
    return f"pl_loss_{name}"


class HostNetworkUnavailable(PipelineError):
    """This machine (or this process) cannot make hosts or a fault between them: not root,
    no ``ip``, no netem, no ``nft``."""


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    result = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip().splitlines()
        raise HostNetworkUnavailable(
            f"`{' '.join(argv)}` failed: {reason[-1] if reason else f'exit {result.returncode}'}"
        )
    return result.stdout


def host_network_problem() -> str | None:
    """Why hosts cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "hosts are network namespaces, which need root (run as root)"
    for tool in ("ip", "setpriv"):
        if shutil.which(tool) is None:
            return f"hosts need `{tool}` (Debian: apt-get install iproute2 util-linux)"
    return None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc().setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise HostNetworkUnavailable(f"setns into a network namespace failed: {os.strerror(errno)}")


@dataclass(frozen=True)
class Host:
    """One host: a network namespace with one address on the bridge."""

    name: str
    netns: str
    address: str

    def command(
        self, argv: Sequence[str], *, uid: int | None = None, gid: int | None = None
    ) -> list[str]:
        """``argv`` run on this host (as ``uid``/``gid`` when given: root is dropped after
        entering the namespace, which only root may do)."""
        prefix = ["ip", "netns", "exec", self.netns]
        if uid is not None:
            prefix += [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={gid if gid is not None else uid}",
                "--clear-groups",
                "--",
            ]
        return [*prefix, *argv]

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block with the calling thread on this host: sockets it opens live here.

        Only this thread moves; the others (and the sockets they opened before) stay
        where they were. The thread is moved back when the block ends.
        """
        with (
            open("/proc/thread-self/ns/net", "rb") as home,
            open(NETNS_DIR / self.netns, "rb") as there,
        ):
            _setns(there.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())


@dataclass
class HostNetwork:
    """Hosts on one bridge, and the faults between them (see the module docstring)."""

    names: Sequence[str]
    owner: int = field(default_factory=os.getpid)
    hosts: dict[str, Host] = field(default_factory=dict, init=False)
    _cuts: set[frozenset[str]] = field(default_factory=set, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def switch(self) -> str:
        return f"pl{self.owner}-sw"

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def create(self) -> HostNetwork:
        """Make the namespaces, the bridge and the links; addresses in ``10.231.0.0/24``."""
        problem = host_network_problem()
        if problem is not None:
            raise HostNetworkUnavailable(problem)
        for name in self.names:
            if not NAME_PATTERN.match(name):
                raise ValueError(f"host name {name!r}: a lowercase letter, then up to 7 of a-z0-9")
        sweep_stale_namespaces()
        try:
            _run(["ip", "netns", "add", self.switch])
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            addresses = SUBNET.hosts()
            for name in self.names:
                host = Host(name, f"pl{self.owner}-{name}", str(next(addresses)))
                self._add(host)
                self.hosts[name] = host
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, host: Host) -> None:
        port = self._port(host)
        _run(["ip", "netns", "add", host.netns])
        _run(
            ["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.netns]
        )
        _run(["ip", "link", "set", port, "netns", self.switch])
        _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", self.switch, "link", "set", port, "up"])
        _run(
            [
                "ip",
                "-n",
                host.netns,
                "addr",
                "add",
                f"{host.address}/{SUBNET.prefixlen}",
                "dev",
                "eth0",
            ]
        )
        _run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])

    def _port(self, host: Host) -> str:
        return f"v{self.owner % 100000}{host.name}"[:15]  # interface names: 15 bytes at most

    def partition(self, a: str, b: str) -> None:
        """Packets between hosts ``a`` and ``b`` vanish, both ways, until :meth:`heal`.

        Each side's neighbour entry for the other is pinned to a hardware address nobody
        has: frames still leave, the bridge floods them, no interface takes them. The
        senders see nothing (no error, no reset), as across a real partition; connections
        hang until a timeout or keepalive gives up. Any number of pairs may be cut at once.
        """
        with self._lock:
            pair = frozenset((a, b))
            if pair in self._cuts:
                return
            for here, there in ((a, b), (b, a)):
                _run(
                    [
                        "ip", "-n", self[here].netns, "neigh", "replace", self[there].address,
                        "lladdr", NOWHERE, "dev", "eth0", "nud", "permanent",
                    ]
                )  # fmt: skip
            self._cuts.add(pair)

    def heal(self, a: str, b: str) -> None:
        """Undo :meth:`partition`: the pinned entries go, address resolution works again."""
        with self._lock:
            pair = frozenset((a, b))
            if pair not in self._cuts:
                return
            for here, there in ((a, b), (b, a)):
                _run(
                    [
                        "ip",
                        "-n",
                        self[here].netns,
                        "neigh",
                        "del",
                        self[there].address,
                        "dev",
                        "eth0",
                    ]
                )
            self._cuts.discard(pair)

    def isolate(self, name: str) -> None:
        """Cut ``name`` from every other host (its link on the bridge goes down)."""
        _run(["ip", "-n", self.switch, "link", "set", self._port(self[name]), "down"])

    def rejoin(self, name: str) -> None:
        _run(["ip", "-n", self.switch, "link", "set", self._port(self[name]), "up"])

    def degrade(self, name: str, delay_ms: float, jitter_ms: float, loss_percent: float) -> None:
        """Delay and loss on every packet ``name`` sends (``tc netem``), until :meth:`restore`."""
        netem = ["netem", "delay", f"{delay_ms}ms", f"{jitter_ms}ms", "loss", f"{loss_percent}%"]
        _run(self._tc(name, "replace", *netem)[0])

    def throttle(self, name: str, rate_kbit: int, burst_bytes: int, latency_ms: int) -> None:
        """``name``'s link, both ways, through a token bucket (``tc tbf``) until :meth:`restore`.

        Both ends of the host's veth are shaped: ``eth0`` in the host (what it sends) and its
        port on the bridge (what it receives). Past ``burst_bytes`` a packet waits for tokens
        at ``rate_kbit``; the queue holds what the rate drains in ``latency_ms``, and packets
        beyond it are dropped, so traffic over the rate sees queueing delay and tail drops.
        """
        tbf = [
            "tbf", "rate", f"{rate_kbit}kbit", "burst", str(burst_bytes),
            "latency", f"{latency_ms}ms",
        ]  # fmt: skip
        try:
            for argv in self._tc(name, "replace", *tbf):
                _run(argv)
        except BaseException:
            self.restore(name)
            raise

    def lose(self, name: str, loss_percent: float) -> None:
        """Drop ``loss_percent`` % of the packets on ``name``'s link, each way, at random,
        until :meth:`restore` (``nft``, for kernels whose ``tc`` has no netem).

        An nftables table at each end of the host's veth filters what arrives there (the
        netdev family's ingress hook): in the host, on ``eth0``, what it receives; in the
        bridge's namespace, on its port, what it sends. Each packet is dropped when
        ``numgen random`` falls under the share, independently of the others, as netem's
        ``loss`` does. Dropping where packets arrive, not where they leave, makes it loss
        on the wire: the sender is never told (an output-hook drop would fail the sender's
        ``send`` with ``EPERM``), and TCP sees it only as missing acknowledgements.
        """
        if not 0 < loss_percent <= 100:
            raise ValueError(f"loss {loss_percent} %: more than 0, at most 100")
        if shutil.which("nft") is None:
            raise HostNetworkUnavailable("`nft` not found (Debian: apt-get install nftables)")
        below = round(loss_percent * 100)  # of 10000: a share to 0.01 %
        try:
            for netns, device in self._ends(name):
                script = (
                    f"table netdev {loss_table(name)} {{\n"
                    f"  chain ingress {{\n"
                    f'    type filter hook ingress device "{device}" priority 0; policy accept;\n'
                    f"    numgen random mod 10000 < {below} counter drop\n"
                    f"  }}\n"
                    f"}}\n"
                )
                _run(["ip", "netns", "exec", netns, "nft", "-f", "-"], stdin=script)
        except BaseException:
            self.restore(name)
            raise

    def lost(self, name: str) -> int:
        """Packets :meth:`lose` has dropped so far on ``name``'s link, both ways summed."""
        dropped = 0
        for netns, _ in self._ends(name):
            table = loss_table(name)
            argv = ["ip", "netns", "exec", netns, "nft", "list", "table", "netdev", table]
            with contextlib.suppress(HostNetworkUnavailable):  # no loss on that end
                dropped += sum(int(m.group(1)) for m in _NFT_DROPS.finditer(_run(argv)))
        return dropped

    def restore(self, name: str) -> None:
        """Undo :meth:`degrade`, :meth:`throttle` and :meth:`lose`: both ends of the link
        unshaped, and no packet dropped at random."""
        for argv in self._tc(name, "del"):
            with contextlib.suppress(HostNetworkUnavailable):  # nothing to remove
                _run(argv)
        if shutil.which("nft") is not None:
            for netns, _ in self._ends(name):
                argv = ["ip", "netns", "exec", netns, "nft", "delete", "table", "netdev"]
                with contextlib.suppress(HostNetworkUnavailable):  # nothing to remove
                    _run([*argv, loss_table(name)])

    def shaped(self, name: str) -> tuple[int, int]:
        """Packets dropped, and times a packet found the bucket empty (``overlimits``), so far
        by the qdiscs on ``name``'s link, both ends summed (``tc -s qdisc show``)."""
        dropped = held = 0
        for argv in self._tc(name, "show"):
            argv.insert(argv.index("tc") + 1, "-s")
            for match in _QDISC_STATS.finditer(_run(argv)):
                dropped += int(match.group(1))
                held += int(match.group(2))
        return dropped, held

    def _ends(self, name: str) -> list[tuple[str, str]]:
        """The two ends of the host's veth, (namespace, interface): its ``eth0``, then its
        port on the bridge."""
        host = self[name]
        return [(host.netns, "eth0"), (self.switch, self._port(host))]

    def _tc(self, name: str, verb: str, *qdisc: str) -> list[list[str]]:
        """``tc qdisc <verb>`` at the root of the host's ``eth0``, then of its bridge port."""
        return [
            ["ip", "netns", "exec", netns, "tc", "qdisc", verb, "dev", device, "root", *qdisc]
            for netns, device in self._ends(name)
        ]

    def heal_all(self) -> None:
        for pair in list(self._cuts):
            self.heal(*sorted(pair))
        for host in self.hosts.values():
            self.rejoin(host.name)

    def close(self) -> None:
        """Delete every namespace of this network (processes still in them lose their links)."""
        for netns in [*(h.netns for h in self.hosts.values()), self.switch]:
            if (NETNS_DIR / netns).exists():
                subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        self.hosts.clear()
        self._cuts.clear()

    def __enter__(self) -> HostNetwork:
        return self.create()

    def __exit__(self, *_: object) -> None:
        self.close()


def sweep_stale_namespaces() -> list[str]:
    """Delete the namespaces of owners that died without closing their network."""
    removed: list[str] = []
    if not NETNS_DIR.is_dir():
        return removed
    for path in NETNS_DIR.iterdir():
        match = _OWNED.match(path.name)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        subprocess.run(["ip", "netns", "del", path.name], capture_output=True, check=False)
        removed.append(path.name)
    return removed
