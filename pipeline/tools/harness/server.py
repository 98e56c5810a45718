"""The life of one throwaway server process: start on a free port, stop, kill, clean up.

Each server runs in its own session (``start_new_session``), so a Ctrl-C aimed at the
owner does not kill it half-way through a test; :meth:`EmbeddedServer.cleanup` (or
``with``) ends it. Should the owner die without cleaning up, SIGKILL included, a
:class:`~pipeline.tools.harness.watchdog.Watchdog` kills the server and deletes the data
directory it made. Constructing a server has no side effects.
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
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self

from pipeline.errors import ServerStartError
from pipeline.tools.harness.binaries import server_env
from pipeline.tools.harness.hosts import Host
from pipeline.tools.harness.processes import kill_tree
from pipeline.tools.harness.watchdog import Watchdog

HOST = "127.0.0.1"
POLL_INTERVAL = 0.05
STOP_TIMEOUT = 30.0
PORT_ATTEMPTS = 3


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Another process may grab it before the server binds; the servers retry with a new port
    in that case unless the caller pinned one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class EmbeddedServer:
    """Process lifecycle shared by both servers; subclasses say how to prepare, spawn and ping.

    ``stop_timeout`` bounds :meth:`stop` (and so :meth:`cleanup`): a server that has not
    shut down cleanly by then is killed. With ``host`` (a network namespace of
    :mod:`~pipeline.tools.harness.hosts`) the server runs on that host and listens on its
    address instead of 127.0.0.1.
    """

    _kind: ClassVar[str]
    _stop_signal: ClassVar[signal.Signals]
    _log_name: ClassVar[str]

    def __init__(
        self,
        data_dir: Path | None,
        port: int | None,
        start_timeout: float,
        stop_timeout: float = STOP_TIMEOUT,
        host: Host | None = None,
    ) -> None:
        self.host = host
        self._owns_data_dir = data_dir is None
        # Path chosen now, created on start(): constructing has no side effects.
        self._data_dir = (
            Path(data_dir).absolute()
            if data_dir is not None
            else Path(tempfile.gettempdir()) / f"pipeline-{self._kind.lower()}-{uuid.uuid4().hex}"
        )
        self._port = port
        self._port_pinned = port is not None
        self._port_proven = False  # True once a server bound it: never switch ports after that
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog = Watchdog()

    @property
    def data_dir(self) -> Path:
        return self._data_dir

    @property
    def address(self) -> str:
        """The address the server listens on: its host's, or 127.0.0.1."""
        return self.host.address if self.host is not None else HOST

    @property
    def port(self) -> int:
        """The TCP port; chosen on first use and then kept across restarts."""
        if self._port is None:
            self._port = free_port()
        return self._port

    @property
    def log_path(self) -> Path:
        return self._data_dir / self._log_name

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def watchdog_pid(self) -> int | None:
        """The process that stops this server should its owner die (see the module doc)."""
        return self._watchdog.pid

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or recover after :meth:`kill`) and return once the server answers."""
        if self.is_running():
            return
        self._kill_tree()  # it died on its own: reap it and any orphaned children first
        self._watchdog.start()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._prepare()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                command, kwargs = self._command(), self._popen_kwargs()
                if self.host is not None:  # enter the namespace as root, then drop root
                    command = self.host.command(
                        command, uid=kwargs.get("user"), gid=kwargs.get("group")
                    )
                    kwargs = {}
                with self.log_path.open("ab") as log:
                    self._proc = subprocess.Popen(
                        command,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=server_env(),
                        cwd=self._data_dir,
                        **kwargs,
                    )
                self._guard()
                with self.host.entered() if self.host is not None else contextlib.nullcontext():
                    self._wait_ready(self._proc, log_offset)
            except BaseException as exc:  # incl. Ctrl-C: never leave a half-started server
                self._kill_tree()
                self._after_exit()  # also when the spawn itself failed
                taken = "Address already in use" in self._log_since(log_offset)
                retry = not (self._port_pinned or self._port_proven) and attempt < PORT_ATTEMPTS
                if isinstance(exc, ServerStartError) and taken and retry:
                    self._port = free_port()  # lost the free_port() race; try another
                    continue
                raise
            self._port_proven = True
            return

    def stop(self, timeout: float | None = None) -> None:
        """Shut down cleanly; SIGKILL after ``timeout`` seconds (default ``stop_timeout``)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, self._stop_signal)
            try:
                proc.wait(timeout=self._stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._kill_tree()
                return
        self._forget()

    def kill(self) -> None:
        """SIGKILL the server and its children, as a crash would, so recovery can be tested.

        Children go too: a surviving Postgres backend would still hold the old shared memory
        and make the next start refuse to run.
        """
        if self._proc is None:
            return
        self._kill_tree()

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self, timeout: float | None = None) -> None:
        """Stop (see :meth:`stop`), and delete the data directory if this object made it."""
        self.stop(timeout)
        if self._owns_data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self._watchdog.guard()  # nothing left to undo
        self._watchdog.close()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.cleanup()  # __exit__ will not run; the error message carries the log tail
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    # -- subclass hooks ---------------------------------------------------------------------

    def _prepare(self) -> None:
        """Find binaries, create/init the data dir; runs before every spawn, so idempotent."""
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    def _ready(self, pid: int) -> bool:
        """True once the server with this pid (not some other one on our port) is serving."""
        raise NotImplementedError

    def _owned_paths(self) -> list[Path]:
        """What the watchdog deletes should the owner die: what this object created."""
        return [self._data_dir] if self._owns_data_dir else []

    def _after_exit(self) -> None:
        """Undo per-run setup once the server is gone; idempotent."""

    # -- internals --------------------------------------------------------------------------

    def _guard(self) -> None:
        """Tell the watchdog what to kill and delete should the owner die from now on."""
        running = [self._proc.pid] if self._proc is not None else []
        self._watchdog.guard(kill=running, remove=self._owned_paths())

    def _kill_tree(self) -> None:
        """SIGKILL the server, its children and their process groups, and wait until gone."""
        proc = self._proc
        if proc is None:
            return
        kill_tree(proc.pid, reap=proc.wait)
        self._forget()

    def _forget(self) -> None:
        self._proc = None
        self._after_exit()
        self._guard()

    def _wait_ready(self, proc: subprocess.Popen[bytes], log_offset: int) -> None:
        deadline = time.monotonic() + self._start_timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self._kind} exited with code {code} during startup "
                    f"(port {self.port}, data dir {self._data_dir}). "
                    f"{self._log_excerpt(log_offset)}"
                )
            if self._ready(proc.pid):
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"{self._kind} did not accept connections on {self.address}:{self.port} within "
                    f"{self._start_timeout:g}s (data dir {self._data_dir}). "
                    f"{self._log_excerpt(log_offset)}"
                )
            time.sleep(POLL_INTERVAL)

    def _log_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                return log.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _log_excerpt(self, offset: int, lines: int = 25) -> str:
        tail = self._log_since(offset).splitlines()[-lines:]
        if not tail:
            return f"{self.log_path} is empty."
        return f"Last lines of {self.log_path}:\n" + "\n".join(tail)
