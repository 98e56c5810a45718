"""A throwaway RabbitMQ cluster on 127.0.0.1: N nodes of Debian's ``rabbitmq-server``.

Each node has its own name (``pl<run>-<i>@localhost``), AMQP, distribution and
management ports (free ports picked at start), data directory and configuration; all
share one Erlang cookie (a ``HOME`` of the cluster's own), so they can cluster and
``rabbitmqctl`` can reach them. Node 1 starts first; nodes 2..N join it as they boot
(peer discovery from their configuration, which names node 1), so forming the cluster
takes no ``rabbitmqctl`` call: each starts an Erlang VM of its own (about a second of CPU
and wall) and ``stop_app`` alone took seconds. A node counts as up once its AMQP listener
accepts (RabbitMQ opens it last, when booted) and its management API lists it running;
the cluster once node 1's lists every node running. A node can be killed
(``SIGKILL`` of its process group), stopped and started again with its data, which is
what the fault tests do. A watchdog process kills the nodes (and deletes the cluster's
directory, if it made it) should the owner die without cleaning up. The machine's own
RabbitMQ (``rabbit@localhost`` on 5672) is never touched: only the shared ``epmd`` name
server is used.

With ``host`` (a network namespace of :mod:`~pipeline.tools.harness.hosts`) every node runs
on that host: started through its command wrapper, listening for AMQP and management on
the host's address, so that processes on other hosts reach it across the bridge (and a
partition cuts them off). Distribution stays on the host's own loopback, with an ``epmd``
of the cluster's own started there (the machine's is in another namespace), and
``rabbitmqctl`` runs on the host too.

The server scripts are run directly (``/usr/lib/rabbitmq/bin``), not through Debian's
``/usr/sbin`` wrappers, which switch to the ``rabbitmq`` account and its fixed paths.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import BinaryNotFoundError, ServerStartError, ServiceUnavailableError
from pipeline.tools.harness.hosts import Host
from pipeline.tools.harness.server import HOST, PORT_ATTEMPTS, free_port
from pipeline.tools.harness.watchdog import Watchdog
from pipeline.transport.amqp.management import Management

SCRIPT_DIRS = (Path("/usr/lib/rabbitmq/bin"), Path("/usr/local/lib/rabbitmq/bin"))
START_TIMEOUT = 180.0
POLL_SECONDS = 0.2  # between readiness checks: a TCP connect and an HTTP GET, cheap
EPMD_PORT = 4369
EPMD_TIMEOUT = 30.0


def find_rabbitmq_bin() -> Path:
    """The directory holding ``rabbitmq-server`` and ``rabbitmqctl`` (not Debian's wrappers)."""
    for directory in SCRIPT_DIRS:
        if (directory / "rabbitmq-server").exists() and (directory / "rabbitmqctl").exists():
            return directory
    raise BinaryNotFoundError(
        "rabbitmq-server not found in "
        + ", ".join(str(d) for d in SCRIPT_DIRS)
        + " (apt-get install rabbitmq-server)"
    )


@dataclass
class RabbitNode:
    index: int
    name: str
    directory: Path
    address: str = HOST  # where clients reach it: 127.0.0.1, or its host's address
    amqp_port: int = 0
    dist_port: int = 0
    management_port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.address}:{self.amqp_port}/%2F"

    @property
    def management_url(self) -> str:
        return f"http://guest:guest@{self.address}:{self.management_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class RabbitCluster:
    """``size`` RabbitMQ nodes clustered on this machine; ``with`` or :meth:`cleanup` ends them."""

    def __init__(
        self,
        size: int = 3,
        base_dir: Path | None = None,
        host: Host | None = None,
        *,
        config: str = "",
        advanced_config: str = "",
    ) -> None:
        """``host``: the nodes run on that host (its address, its command wrapper) instead
        of this machine's loopback. ``config`` is added to every node's ``rabbitmq.conf``
        (lines such as ``consumer_timeout = 5000``); ``advanced_config``, if given, is every
        node's ``advanced.config`` (Erlang terms, for settings ``rabbitmq.conf`` has no key
        for, such as ``[{rabbit, [{channel_tick_interval, 1000}]}].``)."""
        self.size = size
        self.host = host
        self.address = host.address if host is not None else HOST
        self.config = config
        self.advanced_config = advanced_config
        self.run = uuid.uuid4().hex[:6]
        self._owns_dir = base_dir is None
        self.directory = (
            Path(base_dir)
            if base_dir is not None
            else Path(tempfile.gettempdir()) / f"pipeline-rabbitmq-{self.run}"
        )
        self.nodes = [
            RabbitNode(i, f"pl{self.run}-{i}@localhost", self.directory / f"node{i}", self.address)
            for i in range(1, size + 1)
        ]
        self._bin: Path | None = None
        self._epmd: subprocess.Popen[bytes] | None = None
        self._watchdog = Watchdog()

    # -- URLs -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Every node's AMQP URL joined with ``;`` (clients fail over in this order)."""
        return ";".join(node.url for node in self.nodes)

    def url_from(self, index: int) -> str:
        """The node URLs starting at node ``index`` (1-based), so that clients spread."""
        order = self.nodes[index - 1 :] + self.nodes[: index - 1]
        return ";".join(node.url for node in order)

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> RabbitCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def start(self, timeout: float = START_TIMEOUT) -> None:
        self._bin = find_rabbitmq_bin()
        self._watchdog.start()
        self.directory.mkdir(parents=True, exist_ok=True)
        cookie = self.directory / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(f"PIPELINE{uuid.uuid4().hex.upper()}")
            cookie.chmod(0o400)
        if self.host is not None:
            self._start_epmd()
        deadline = time.monotonic() + timeout
        first, rest = self.nodes[0], self.nodes[1:]
        # Node 1 first: a node that boots while none it names answers starts on its own.
        self._spawn_new(first)
        self._await_new(first, deadline)
        for node in rest:
            self._spawn_new(node)
        for node in rest:
            self._await_new(node, deadline)
        self.await_members(deadline)

    def _start_epmd(self) -> None:
        """The host's own ``epmd`` on its loopback, a child of this object: the nodes would
        otherwise start a daemon that outlives the cluster in the host's namespace."""
        assert self.host is not None
        epmd = shutil.which("epmd") or "epmd"
        log = (self.directory / "epmd.log").open("ab")
        self._epmd = subprocess.Popen(
            self.host.command([epmd, "-address", HOST]),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self._guard()
        deadline = time.monotonic() + EPMD_TIMEOUT
        while not self._epmd_answers():
            if self._epmd.poll() is not None or time.monotonic() >= deadline:
                raise ServerStartError(f"epmd on host {self.host.name} did not start")
            time.sleep(POLL_SECONDS)

    def _epmd_answers(self) -> bool:
        assert self.host is not None
        with (
            self.host.entered(),
            contextlib.suppress(OSError),
            socket.create_connection((HOST, EPMD_PORT), timeout=2),
        ):
            return True
        return False

    def _spawn_new(self, node: RabbitNode) -> None:
        """Start a node for the first time, on ports picked just before (the sooner a
        free port is bound, the less likely another process on the machine took it)."""
        node.amqp_port, node.dist_port, node.management_port = (
            free_port(),
            free_port(),
            free_port(),
        )
        self._write_config(node)
        self._spawn(node)

    def _await_new(self, node: RabbitNode, deadline: float) -> None:
        """Wait for a node's first boot. A port picked free can be taken by another process
        (a client's outgoing connection, on a busy machine) before the node binds it: the
        node then exits at once, its log naming the port, and boots again on other ports."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self.await_node(node, deadline)
                return
            except ServerStartError:
                if node.running or attempt == PORT_ATTEMPTS or not self._port_clash(node):
                    raise
            # the failed boot's log kept beside, so the next boot's is read alone
            (node.directory / "node.log").rename(node.directory / f"node.{attempt}.log")
            self._spawn_new(node)

    @staticmethod
    def _port_clash(node: RabbitNode) -> bool:
        path = node.directory / "node.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "already_used" in text or "eaddrinuse" in text

    def _write_config(self, node: RabbitNode) -> None:
        node.directory.mkdir(parents=True, exist_ok=True)
        config = (
            f"listeners.tcp.1 = {self.address}:{node.amqp_port}\n"
            "loopback_users = none\n"
            f"management.tcp.port = {node.management_port}\n"
            f"management.tcp.ip = {self.address}\n"
            # Stats every second, so that listings (queue depths, members) are fresh.
            "collect_statistics_interval = 1000\n"
        )
        if node.index > 1:
            # Joins node 1 on its first boot (a restart keeps the cluster it has). Only
            # node 1 and itself are named: another new node would be a cluster of its own.
            config += (
                "cluster_formation.peer_discovery_backend = classic_config\n"
                f"cluster_formation.classic_config.nodes.1 = {self.nodes[0].name}\n"
                f"cluster_formation.classic_config.nodes.2 = {node.name}\n"
            )
        if self.config:
            config += self.config.strip() + "\n"
        (node.directory / "rabbitmq.conf").write_text(config)
        if self.advanced_config:
            (node.directory / "advanced.config").write_text(self.advanced_config.strip() + "\n")
        (node.directory / "enabled_plugins").write_text("[rabbitmq_management].\n")
        (node.directory / "rabbitmq-env.conf").write_text("")

    def _env(self, node: RabbitNode) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_"))
        }
        directory = node.directory
        env.update(
            HOME=str(self.directory),  # the shared .erlang.cookie
            RABBITMQ_CONF_ENV_FILE=str(directory / "rabbitmq-env.conf"),
            RABBITMQ_NODENAME=node.name,
            RABBITMQ_NODE_IP_ADDRESS=self.address,
            RABBITMQ_NODE_PORT=str(node.amqp_port),
            RABBITMQ_DIST_PORT=str(node.dist_port),
            RABBITMQ_MNESIA_BASE=str(directory / "mnesia"),
            RABBITMQ_LOG_BASE=str(directory / "log"),
            RABBITMQ_LOGS="-",
            RABBITMQ_CONFIG_FILE=str(directory / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(directory / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(directory / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(directory / "pid"),
            ERL_EPMD_ADDRESS=HOST,
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    def _spawn(self, node: RabbitNode) -> None:
        assert self._bin is not None
        log = (node.directory / "node.log").open("ab")
        node.process = subprocess.Popen(
            self._on_host([str(self._bin / "rabbitmq-server")]),
            env=self._env(node),
            cwd=node.directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self._guard()

    def _guard(self) -> None:
        """Tell the watchdog which nodes run now (and what to delete) should the owner die."""
        pids = [node.process.pid for node in self.nodes if node.running and node.process]
        if self._epmd is not None and self._epmd.poll() is None:
            pids.append(self._epmd.pid)
        self._watchdog.guard(kill=pids, remove=[self.directory] if self._owns_dir else [])

    def ctl(self, node: RabbitNode, *args: str, timeout: float = 120.0) -> str:
        """``rabbitmqctl -n <node> args...``; raises :class:`ServerStartError` on failure."""
        assert self._bin is not None
        result = subprocess.run(
            self._on_host([str(self._bin / "rabbitmqctl"), "-n", node.name, *args]),
            env=self._env(node),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise ServerStartError(
                f"rabbitmqctl {' '.join(args)} on {node.name} failed: "
                f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}"
            )
        return result.stdout

    def _on_host(self, argv: list[str]) -> list[str]:
        """``argv`` on the cluster's host (where its epmd and distribution ports are)."""
        return self.host.command(argv) if self.host is not None else argv

    def await_node(self, node: RabbitNode, deadline: float) -> None:
        """Wait until the node serves (see :meth:`serves`), or raise with its log's tail."""
        while not self.serves(node):
            if not node.running:
                raise ServerStartError(f"RabbitMQ node {node.name} exited: {self.log_tail(node)}")
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"RabbitMQ node {node.name} not up in time: {self.log_tail(node)}"
                )
            time.sleep(POLL_SECONDS)

    def serves(self, node: RabbitNode) -> bool:
        """The node's AMQP listener accepts and its management API lists it running.

        RabbitMQ opens its client listeners last, once its boot steps and plugins ran (what
        ``rabbitmqctl await_startup`` waits for), and checking that costs no Erlang VM.
        """
        if not node.running:
            return False
        try:
            with socket.create_connection((node.address, node.amqp_port), timeout=2):
                pass
        except OSError:
            return False
        return node.name in self.running_members(node)

    def running_members(self, node: RabbitNode) -> set[str]:
        """The cluster's running nodes as ``node``'s management API lists them (none when
        it does not answer)."""
        try:
            listed = Management(node.url, node.management_url, timeout=5).nodes()
        except ServiceUnavailableError:
            return set()
        return {str(entry["name"]) for entry in listed if entry.get("running")}

    def await_members(self, deadline: float) -> None:
        """Wait until node 1 lists every node of the cluster running (or raise)."""
        first = self.nodes[0]
        wanted = {node.name for node in self.nodes}
        while (members := self.running_members(first)) != wanted:
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"RabbitMQ cluster not formed in time: {first.name} lists "
                    f"{sorted(members)} running, not {sorted(wanted)}"
                )
            time.sleep(POLL_SECONDS)

    def log_tail(self, node: RabbitNode, lines: int = 5) -> str:
        path = node.directory / "node.log"
        if not path.exists():
            return "(no log)"
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])

    # -- faults -----------------------------------------------------------------------------
    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (1-based) and everything in its process group."""
        node = self.nodes[index - 1]
        if node.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        node.process.wait(timeout=30)
        self._guard()

    def stop(self, index: int, timeout: float = 60.0) -> None:
        """Stop node ``index`` cleanly (``rabbitmqctl stop``), killing it if that fails."""
        node = self.nodes[index - 1]
        if not node.running:
            return
        try:
            self.ctl(node, "stop", timeout=timeout)
            assert node.process is not None
            node.process.wait(timeout=timeout)
        except (ServerStartError, subprocess.TimeoutExpired):
            self.kill(index)

    def restart(self, index: int, timeout: float = START_TIMEOUT) -> None:
        """Start node ``index`` again on its data (it rejoins the cluster by itself)."""
        node = self.nodes[index - 1]
        if node.running:
            return
        self._spawn(node)
        self.await_node(node, time.monotonic() + timeout)

    def cleanup(self) -> None:
        """Kill every node and delete the cluster's directory (if this object made it)."""
        for node in self.nodes:
            if node.running:
                self.kill(node.index)
        if self._epmd is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._epmd.pid, signal.SIGKILL)
            self._epmd.wait(timeout=30)
            self._epmd = None
        if self._owns_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
        self._watchdog.guard()  # nothing left to undo
        self._watchdog.close()
