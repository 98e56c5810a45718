"""The faults the drill injects, when, and how each is done.

The schedule comes from the seeded RNG: which kinds (every selected kind at least once when
there are enough faults), at which points of the production window, on which targets, for
how long. Faults run one after another on the drill's main thread when production reaches
their point; one that falls due while the previous is still running starts right after it.
``clock-skew`` is not injected here: it is a segment of the producer's plan placed by a
producer process with a shifted clock.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.tools.drill.members import Kind, Member, Members
from pipeline.tools.drill.network import (
    NETWORK_DESCRIPTIONS,
    NETWORK_KINDS,
    PROXY_KINDS,
    NetworkFaults,
)
from pipeline.tools.drill.rabbit import (
    RABBIT_DESCRIPTIONS,
    RABBIT_KINDS,
    RabbitFaults,
    rabbit_seconds,
)
from pipeline.tools.drill.sql import DrillQueries

KINDS = (
    "relay-kill",
    "relay-pause",
    "worker-kill",
    "listen-terminate",
    "worker-terminate",
    "worker-pause",
    "postgres-restart-fast",
    "postgres-restart-immediate",
    "redis-restart-always",
    "redis-restart-everysec",
    "redis-restart-volatile",
    "redis-down",
    "proxy-drop",
    "proxy-stall",
    "clock-skew",
    *NETWORK_KINDS,
    "sentinel-kill-master",
    "sentinel-failover",
    *RABBIT_KINDS,
)
DESCRIPTIONS = {
    "relay-kill": "SIGKILL of a relay process, restarted after 0.5-3 s",
    "relay-pause": "SIGSTOP of a relay, 1-3 s longer than the lease, then SIGCONT",
    "worker-kill": "SIGKILL of a worker's process group, restarted after 0.5-3 s",
    "listen-terminate": "pg_terminate_backend of relays' LISTEN connections",
    "worker-terminate": "pg_terminate_backend of every database connection of workers",
    "worker-pause": "SIGSTOP of a worker's process group for 2-6 s longer than the broker "
    "heartbeat timeout, then SIGCONT",
    "postgres-restart-fast": "Postgres stopped with -m fast and started again",
    "postgres-restart-immediate": "Postgres stopped with -m immediate (crash) and started again",
    "redis-restart-always": "Redis SIGKILLed and restarted, AOF with appendfsync always",
    "redis-restart-everysec": "Redis SIGKILLed and restarted, AOF with appendfsync everysec",
    "redis-restart-volatile": "Redis SIGKILLed and restarted without persistence: data lost",
    "redis-down": "Redis shut down for 2-6 s, then started again (data kept)",
    "proxy-drop": "every connection through the proxy to Postgres and/or Redis dropped",
    "proxy-stall": "all traffic through the proxy to Postgres and/or Redis stalled 1-4 s",
    "clock-skew": "a stretch of orders placed by a producer whose clock is shifted",
    **NETWORK_DESCRIPTIONS,
    "sentinel-kill-master": "the Sentinel-watched master SIGKILLed (a failover), back later as "
    "a replica",
    "sentinel-failover": "a failover forced with SENTINEL FAILOVER",
    **RABBIT_DESCRIPTIONS,
}
OWNED_ONLY = frozenset(
    kind for kind in KINDS if kind.startswith(("postgres-", "redis-", "sentinel-", "rabbit-"))
)
"""Faults done to a server, which the drill does only to servers it started itself."""
SENTINEL_ONLY = frozenset(kind for kind in KINDS if kind.startswith("sentinel-"))
"""Faults of a Redis watched by Sentinel (``--sentinel``)."""
REDIS_ALONE = frozenset(kind for kind in KINDS if kind.startswith("redis-"))
"""Faults of one Redis process, which ``--sentinel`` replaces with a master and a replica."""
HOSTS_ONLY = frozenset(NETWORK_KINDS)
"""Faults between hosts, which need ``--hosts``."""
RABBIT_ONLY = frozenset(RABBIT_KINDS)
"""Faults of the drill's RabbitMQ cluster (``--transport amqp``)."""
ONE_HOST_KINDS = tuple(
    kind for kind in KINDS if kind not in HOSTS_ONLY | SENTINEL_ONLY | RABBIT_ONLY
)
"""What a drill on one host (the default) may inject."""
STAGING_KINDS = tuple(kind for kind in ONE_HOST_KINDS if kind not in OWNED_ONLY)
"""What a drill against given servers may inject."""
HOSTS_KINDS = tuple(
    kind for kind in KINDS if kind not in SENTINEL_ONLY | RABBIT_ONLY | set(PROXY_KINDS)
)
"""What a drill across hosts may inject."""
SENTINEL_KINDS = tuple(kind for kind in ONE_HOST_KINDS if kind not in REDIS_ALONE) + tuple(
    sorted(SENTINEL_ONLY)
)
"""What a drill on a Redis watched by Sentinel may inject."""
AMQP_KINDS = tuple(kind for kind in ONE_HOST_KINDS if kind not in REDIS_ALONE) + RABBIT_KINDS
"""What a drill on its own RabbitMQ cluster may inject (``--transport amqp``)."""
HOSTS_AMQP_KINDS = tuple(
    kind
    for kind in KINDS
    if kind not in REDIS_ALONE | SENTINEL_ONLY | set(PROXY_KINDS) and kind != "rabbit-stall"
)
"""What a drill across hosts on its own RabbitMQ cluster may inject: the network kinds and
the RabbitMQ ones, except ``rabbit-stall``, which works through the proxies."""
FIND_CONNECTIONS_SECONDS = 5.0
FLOW_BACK_SECONDS = 60.0
"""Longest a Sentinel fault waits to see the relays mark an event sent on the new master
(the report then says nothing was; the run's recovery bound judges the rest)."""
DEFAULT_LEASE_SECONDS = 30.0  # PIPELINE_LEASE_SECONDS when the processes' environment has none


def heartbeat_seconds(env: dict[str, str]) -> float:
    """The workers' broker heartbeat timeout, from their environment (else the default)."""
    value = env.get("PIPELINE_BROKER_HEARTBEAT_TIMEOUT_MS")
    if value is None:
        default = Settings.model_fields["broker_heartbeat_timeout_ms"].default
        return float(default) / 1000
    return float(value) / 1000


@dataclass
class Fault:
    kind: str
    offset: float  # planned seconds after the start of production
    target: str = ""
    seconds: float = 0.0  # how long it lasts (down time, stall, restart delay), planned
    skew: float = 0.0  # clock-skew: the shift, in seconds
    started: float | None = None  # wall clock (time.time())
    ended: float | None = None
    detail: str = ""
    violation: str = ""  # a guarantee the fault itself checks and saw broken

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "started": self.started,
            "ended": self.ended,
            "detail": self.detail,
        }


def schedule(
    kinds: tuple[str, ...],
    count: int,
    window: float,
    rng: random.Random,
    network_seconds: float = 30.0,
    broker: str = "redis",
) -> list[Fault]:
    """``count`` faults over ``window`` seconds: each kind once (if ``count`` allows), then
    kinds at random, at random moments between 5 % and 90 % of the window. Network faults
    last between 5 s (or ``network_seconds`` if shorter) and ``network_seconds``. Proxy
    faults target Postgres, the ``broker`` (its name) or both."""
    if count <= 0 or not kinds:
        return []
    chosen = list(kinds) if count >= len(kinds) else rng.sample(list(kinds), count)
    chosen += [rng.choice(kinds) for _ in range(count - len(chosen))]
    rng.shuffle(chosen)
    offsets = sorted(rng.uniform(0.05, 0.9) * window for _ in chosen)
    faults = []
    for kind, offset in zip(chosen, offsets, strict=True):
        fault = Fault(kind, offset)
        if kind in ("relay-kill", "worker-kill"):
            fault.seconds = rng.uniform(0.5, 3.0)
        elif kind == "relay-pause":
            fault.seconds = rng.uniform(1.0, 3.0)  # beyond the lease
        elif kind in ("redis-down", "sentinel-kill-master"):
            fault.seconds = rng.uniform(2.0, 6.0)
        elif kind == "worker-pause":
            fault.seconds = rng.uniform(2.0, 6.0)  # beyond the heartbeat timeout
        elif kind == "redis-restart-everysec":
            fault.seconds = rng.uniform(0.5, 2.0)  # traffic under everysec before the crash
        elif kind == "proxy-stall":
            fault.seconds = rng.uniform(1.0, 4.0)
        elif kind == "clock-skew":
            fault.seconds = rng.uniform(2.0, 5.0)
            fault.skew = rng.choice((-1, 1)) * rng.uniform(60.0, 3600.0)
        elif kind in HOSTS_ONLY:
            fault.seconds = rng.uniform(min(5.0, network_seconds), network_seconds)
        elif kind in RABBIT_ONLY:
            fault.seconds = rabbit_seconds(kind, rng)
        if kind.startswith("proxy-"):
            fault.target = rng.choice(("postgres", broker, "both"))
        faults.append(fault)
    return faults


class Proxies:
    """The drill's proxies in front of Postgres and the broker (none where none runs): one
    for Redis, one per node of a RabbitMQ cluster; ``broker`` names the broker."""

    def __init__(self, postgres: Any, broker: Any, name: str = "redis") -> None:
        self.broker = name
        self.by_name: dict[str, list[Any]] = {
            "postgres": [postgres] if postgres is not None else [],
            name: list(broker) if isinstance(broker, list) else [broker] if broker else [],
        }

    def send(self, target: str, command: str) -> str:
        names = ("postgres", self.broker) if target == "both" else (target,)
        answers = []
        for name in names:
            proxies = self.by_name.get(name) or []
            said = "; ".join(proxy.command(command) for proxy in proxies) or "no proxy"
            answers.append(f"{name}: {said}")
        return ", ".join(answers)


@dataclass
class Injector:
    """Does each fault; runs on the main thread (it starts processes)."""

    members: Members
    database_url: str
    queries: DrillQueries
    proxies: Proxies
    rng: random.Random
    postgres: Any = None  # OwnedPostgres when the drill owns the server
    redis: Any = None  # OwnedRedis likewise
    network: NetworkFaults | None = None  # across hosts (--hosts)
    sentinel: Any = None  # the SentinelSet (--sentinel)
    rabbit: RabbitFaults | None = None  # the drill's RabbitMQ cluster (--transport amqp)
    wait: Callable[[float], None] = time.sleep
    done: list[Fault] = field(default_factory=list)

    def inject(self, fault: Fault) -> None:
        fault.started = time.time()
        try:
            fault.detail = self._do(fault)
        except Exception as exc:  # a fault that could not be done is reported, not fatal
            fault.detail = f"could not be done: {type(exc).__name__}: {str(exc)[:200]}"
        fault.ended = time.time()
        self.done.append(fault)

    def _do(self, fault: Fault) -> str:
        kind = fault.kind
        if kind in ("relay-kill", "worker-kill"):
            return self._kill(fault, "relay" if kind == "relay-kill" else "worker")
        if kind == "relay-pause":
            return self._pause(fault, "relay")
        if kind == "listen-terminate":
            return self._terminate(fault, "relay", "listen_backends")
        if kind == "worker-terminate":
            return self._terminate(fault, "worker", "app_backends")
        if kind == "worker-pause":
            return self._pause_worker(fault)
        if kind.startswith("postgres-restart-"):
            mode = kind.removeprefix("postgres-restart-")
            down = self.postgres.restart(mode)
            return f"down {down:.1f} s"
        if kind.startswith("redis-restart-"):
            mode = kind.removeprefix("redis-restart-")
            self.redis.prepare(mode)
            if fault.seconds:
                self.wait(fault.seconds)
            down = self.redis.crash(mode)
            return f"down {down:.1f} s" + (" (came back empty)" if mode == "volatile" else "")
        if kind == "redis-down":
            return f"down {self.redis.down(fault.seconds):.1f} s"
        if kind in HOSTS_ONLY:
            if self.network is None:
                raise ValueError(f"{kind} needs hosts (--hosts)")
            fault.target, detail = self.network.do(kind, fault.seconds)
            return detail
        if kind == "sentinel-kill-master":
            old, named = self.sentinel.kill_master()
            began = time.monotonic() - named
            flow = self._flow_back(began)
            self.wait(max(0.0, fault.seconds - (time.monotonic() - began - named)))
            self.sentinel.rejoin(old)
            return (
                f"master killed, a new one named after {named:.1f} s, {flow}; the old one back "
                f"{fault.seconds:.1f} s later as a replica"
            )
        if kind in RABBIT_ONLY:
            if self.rabbit is None:
                raise ValueError(f"{kind} needs the drill's RabbitMQ (--transport amqp)")
            return self.rabbit.do(fault)
        if kind == "sentinel-failover":
            took = self.sentinel.force_failover()
            flow = self._flow_back(time.monotonic() - took)
            return f"failover forced, done in {took:.1f} s, {flow}"
        if kind == "proxy-drop":
            return self.proxies.send(fault.target, "drop")
        if kind == "proxy-stall":
            answer = self.proxies.send(fault.target, f"stall {fault.seconds:.2f}")
            self.wait(fault.seconds)
            return f"{fault.seconds:.1f} s; {answer}"
        raise ValueError(f"unknown fault kind {kind!r}")

    def _kill(self, fault: Fault, kind: Kind) -> str:
        member = self.rng.choice(self.members.of(kind))
        fault.target = member.name
        self.members.kill(member)
        self.wait(fault.seconds)
        self.members.start(member)
        return f"{member.name} killed, restarted after {fault.seconds:.1f} s"

    def _pause(self, fault: Fault, kind: Kind) -> str:
        """Stop a member (SIGSTOP) for ``fault.seconds`` longer than the lease, then let it
        go on (SIGCONT): its claims expire while it still holds what it had open."""
        running = [member for member in self.members.of(kind) if member.running()]
        if not running:
            return f"no {kind} running"
        member = self.rng.choice(running)
        fault.target = member.name
        lease = float(self.members.env.get("PIPELINE_LEASE_SECONDS", DEFAULT_LEASE_SECONDS))
        pause = lease + fault.seconds
        assert member.child is not None  # running
        child = member.child
        child.pause()
        try:
            self.wait(pause)
        finally:
            child.resume()
        return f"{member.name} stopped {pause:.1f} s (lease {lease:g} s), then continued"

    def _pause_worker(self, fault: Fault) -> str:
        """SIGSTOP a worker's process group (a frozen host, a stuck VM) past the heartbeat
        timeout, so its unacknowledged messages go to the other workers, then SIGCONT:
        it comes back to transactions and messages that others may have taken over."""
        member = self.rng.choice(self.members.of("worker"))
        fault.target = member.name
        paused = heartbeat_seconds(self.members.env) + fault.seconds
        if not self.members.pause(member):
            return f"{member.name} is not running"
        try:
            self.wait(paused)
        finally:
            self.members.resume(member)
        return f"{member.name} stopped {paused:.1f} s, then continued"

    def _sent(self) -> int:
        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=10) as conn:
            row = conn.execute(self.queries.text("sent_events")).fetchone()
        return int(row[0]) if row else 0

    def _flow_back(self, began: float) -> str:
        """When the relays marked an event sent again after a failover that ``began`` (a
        monotonic time): publishing on the new master, the flow back an operator waits for."""
        before = self._sent()
        deadline = time.monotonic() + FLOW_BACK_SECONDS
        while time.monotonic() < deadline:
            self.wait(0.2)
            if self._sent() > before:
                return f"events marked sent again {time.monotonic() - began:.1f} s after it began"
        return f"no event marked sent within {FLOW_BACK_SECONDS:g} s of the new master"

    def _terminate(self, fault: Fault, kind: Kind, query: str) -> str:
        members: list[Member] = self.members.of(kind)
        if self.rng.random() < 0.5:
            members = [self.rng.choice(members)]
        fault.target = ", ".join(member.name for member in members)
        names = [member.application_name for member in members]
        deadline = time.monotonic() + FIND_CONNECTIONS_SECONDS
        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=10) as conn:
            while True:  # right after another fault the processes may still be reconnecting
                found = conn.execute(self.queries.text(query), {"names": names}).fetchall()
                if {row[1] for row in found} >= set(names) or time.monotonic() > deadline:
                    break
                self.wait(0.2)
            pids = [row[0] for row in found]
            if not pids:
                return f"no connection of {fault.target} found"
            row = conn.execute(self.queries.text("terminate"), {"pids": pids}).fetchone()
        terminated = int(row[0]) if row else 0
        extra = []
        if query == "app_backends":
            busy = sum(1 for row in found if row[2] not in ("idle", None))
            extra.append(f"{busy} in a statement or transaction")
        missing = [m.name for m in members if m.application_name not in {r[1] for r in found}]
        if missing:
            extra.append(f"none found of {', '.join(missing)}")
        detail = f" ({'; '.join(extra)})" if extra else ""
        return f"terminated {terminated} connections of {fault.target}{detail}"
