"""A throwaway Redis on 127.0.0.1, not persisted unless asked to (then fsynced on every write)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

from pipeline.tools.harness.binaries import find_redis_server
from pipeline.tools.harness.hosts import Host
from pipeline.tools.harness.server import STOP_TIMEOUT, EmbeddedServer


class EmbeddedRedis(EmbeddedServer):
    """A private Redis on 127.0.0.1, for the Dramatiq broker in tests and ``pipeline demo``.

    By default nothing is persisted (a kill loses every key, like a cache flush). With
    ``persistent=True`` the append-only file is fsynced on every write, so an acknowledged
    write survives :meth:`kill`: slower, but deterministic for crash tests.
    """

    _kind = "Redis"
    _stop_signal = signal.SIGTERM
    _log_name = "redis.log"

    def __init__(
        self,
        data_dir: Path | None = None,
        port: int | None = None,
        *,
        persistent: bool = False,
        executable: Path | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = STOP_TIMEOUT,
        host: Host | None = None,
    ) -> None:
        super().__init__(data_dir, port, start_timeout, stop_timeout, host)
        self.persistent = persistent
        self._executable_override = executable
        self._executable: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"

    @property
    def executable(self) -> Path | None:
        """The redis-server binary in use, once started."""
        return self._executable

    def _prepare(self) -> None:
        if self._executable is None:
            self._executable = find_redis_server(self._executable_override)
        self._data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _command(self) -> list[str]:
        assert self._executable is not None
        command = [
            str(self._executable),
            "--port",
            str(self.port),
            "--bind",
            self.address,
            "--dir",
            str(self._data_dir),
            "--daemonize",
            "no",
            "--logfile",
            "",  # stdout, which is our log file
            "--save",
            "",
        ]
        if self.persistent:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            command += ["--appendonly", "no"]
        return command

    def _ready(self, pid: int) -> bool:
        info = self._info()
        # INFO is answered while the AOF is still loading, hence the loading check; the pid
        # check proves the port is ours, not whoever won a free_port() race.
        return info.get("process_id") == str(pid) and info.get("loading") == "0"

    def _info(self) -> dict[str, str]:
        """``INFO`` over a raw socket: readiness must not depend on a client library."""
        try:
            # Short timeout: a stranger on our port may never answer; a miss just re-polls.
            with socket.create_connection((self.address, self.port), timeout=0.25) as sock:
                sock.sendall(b"INFO\r\n")
                data = b""
                while b"\r\n" not in data:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return {}
                    data += chunk
                header, _, body = data.partition(b"\r\n")
                if not header.startswith(b"$"):
                    return {}  # an error reply
                size = int(header[1:])
                while len(body) < size:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return {}
                    body += chunk
        except (OSError, ValueError):
            return {}
        pairs = (line.split(":", 1) for line in body.decode("utf-8", "replace").splitlines())
        return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}
