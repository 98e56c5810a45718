"""A Redis set watched by Sentinel, throwaway, for tests and the drill: a master, a replica and
three sentinels on 127.0.0.1, or all on one host of :mod:`~pipeline.tools.harness.hosts`
(quorum two), failing over within a few seconds.

:class:`SentinelSet` starts them, names the URL the pipeline takes
(``redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/<service>``), tells which node
is the master now, and makes failovers happen: :meth:`SentinelSet.kill_master` (the master
dies; the sentinels agree it is down and promote the replica) and
:meth:`SentinelSet.force_failover` (``SENTINEL FAILOVER``, as an operator would before
maintenance). A killed master started again comes back as a replica of the new master.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from pipeline.errors import ServerStartError
from pipeline.tools.harness.hosts import Host
from pipeline.tools.harness.redis_server import EmbeddedRedis

SERVICE = "pipeline"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
FAILOVER_WAIT = 120.0  # a rejoin waits for the sentinels' 10 s INFO round, slower on a busy host


class EmbeddedSentinel(EmbeddedRedis):
    """A ``redis-server --sentinel`` watching one master under :data:`SERVICE`."""

    _kind = "Sentinel"
    _log_name = "sentinel.log"

    def __init__(self, master_port: int, quorum: int = 2, host: Host | None = None) -> None:
        super().__init__(host=host)
        self.master_port = master_port
        self.quorum = quorum

    def _command(self) -> list[str]:
        assert self._executable is not None
        config = self._data_dir / "sentinel.conf"
        if not config.exists():  # the sentinel rewrites it with what it learns: keep that
            config.write_text(
                f"port {self.port}\n"
                f"bind {self.address}\n"
                f"dir {self._data_dir}\n"
                f"sentinel monitor {SERVICE} {self.address} {self.master_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
        return [str(self._executable), str(config), "--sentinel", "--logfile", ""]

    def _ready(self, pid: int) -> bool:
        return self._info().get("process_id") == str(pid)  # a sentinel loads nothing


class ReplicaRedis(EmbeddedRedis):
    """A Redis that starts as a replica of ``master_port`` (persistence off, as in tests)."""

    def __init__(self, master_port: int, host: Host | None = None) -> None:
        super().__init__(host=host)
        self.master_port = master_port

    def _command(self) -> list[str]:
        return [*super()._command(), "--replicaof", self.address, str(self.master_port)]


class SentinelSet:
    """Master, replica and three sentinels (see the module docstring); with ``host`` all five
    run on that host (the drill across hosts puts them on its broker host)."""

    def __init__(self, host: Host | None = None) -> None:
        self.host = host
        self.nodes: list[EmbeddedRedis] = [EmbeddedRedis(host=host)]
        self.sentinels: list[EmbeddedSentinel] = []

    @property
    def address(self) -> str:
        """The address every node and sentinel listens on."""
        return self.nodes[0].address

    @property
    def url(self) -> str:
        hosts = ",".join(f"{self.address}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> SentinelSet:
        try:
            first = self.nodes[0]
            first.start()
            replica = ReplicaRedis(first.port, self.host)
            self.nodes.append(replica)
            replica.start()
            self._wait(lambda: self._replicas_of(first.port) >= 1, "the replica to sync")
            for _ in range(3):
                sentinel = EmbeddedSentinel(first.port, host=self.host)
                self.sentinels.append(sentinel)
                sentinel.start()
            self._wait(self._sentinels_agree, "the sentinels to find each other and the replica")
        except BaseException:
            self.close()
            raise
        return self

    def master(self) -> EmbeddedRedis:
        """The node the sentinels name as master now."""
        port = self.master_port()
        for node in self.nodes:
            if node.port == port:
                return node
        raise ServerStartError(f"the sentinels name a master on port {port}, not one of ours")

    def master_port(self) -> int:
        for sentinel in self.sentinels:
            try:
                with self._client(sentinel.port, 2) as client:
                    address = client.sentinel_get_master_addr_by_name(SERVICE)
            except redis.RedisError:
                continue
            if address:
                return int(address[1])
        raise ServerStartError("no sentinel answered with a master")

    def kill_master(self) -> tuple[EmbeddedRedis, float]:
        """SIGKILL the master; returns it (dead) and the seconds until a new master is named."""
        old = self.master()
        began = time.monotonic()
        old.kill()
        self._wait(lambda: self._promoted(old.port), "a failover after the master died")
        return old, time.monotonic() - began

    def force_failover(self) -> float:
        """``SENTINEL FAILOVER``: the replica promoted without a failure; seconds it took."""
        old_port = self.master_port()
        self._wait(self._good_replica, "a replica the sentinels may promote")
        began = time.monotonic()
        with self._client(self.sentinels[0].port, 5) as client:
            client.execute_command("SENTINEL", "FAILOVER", SERVICE)
        self._wait(lambda: self._promoted(old_port), "a forced failover")
        return time.monotonic() - began

    def rejoin(self, node: EmbeddedRedis) -> None:
        """Start a node that died again: the sentinels make it a replica of the new master."""
        node.start()
        master = self.master()
        self._wait(lambda: self._replicas_of(master.port) >= 1, "the old master to rejoin")
        self._wait(self._good_replica, "the sentinels to see the rejoined replica as healthy")

    def close(self) -> None:
        for server in [*self.sentinels, *self.nodes]:
            server.cleanup()

    def __enter__(self) -> SentinelSet:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _client(self, port: int, timeout: float) -> redis.Redis:
        return redis.Redis(host=self.address, port=port, socket_timeout=timeout)

    def _promoted(self, old_port: int) -> bool:
        try:
            port = self.master_port()
        except ServerStartError:
            return False
        if port == old_port:
            return False
        with self._client(port, 2) as client:
            try:
                return bool(client.info("replication").get("role") == "master")
            except redis.RedisError:
                return False

    def _replicas_of(self, port: int) -> int:
        try:
            with self._client(port, 2) as client:
                info = client.info("replication")
        except redis.RedisError:
            return 0
        return sum(
            1
            for key, value in info.items()
            if key.startswith("slave")
            and isinstance(value, dict)
            and value.get("state") == "online"
        )

    def _good_replica(self) -> bool:
        """Every sentinel lists a replica in sync with the master (one it may promote)."""
        for sentinel in self.sentinels:
            try:
                with self._client(sentinel.port, 2) as client:
                    replicas = client.sentinel_slaves(SERVICE)
            except redis.RedisError:
                return False
            if not any(
                replica.get("flags") == "slave" and replica.get("master-link-status") == "ok"
                for replica in replicas
            ):
                return False
        return True

    def _sentinels_agree(self) -> bool:
        try:
            with self._client(self.sentinels[0].port, 2) as client:
                master = client.sentinel_master(SERVICE)
        except redis.RedisError:
            return False
        return (
            int(master.get("num-other-sentinels", 0)) >= 2 and int(master.get("num-slaves", 0)) >= 1
        )

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + FAILOVER_WAIT
        while not ready():
            if time.monotonic() > deadline:
                raise ServerStartError(f"timed out waiting for {what}")
            time.sleep(0.1)
