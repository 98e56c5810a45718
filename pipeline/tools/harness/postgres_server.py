"""A throwaway Postgres: initdb on first start, trust auth on 127.0.0.1, a private socket."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from pipeline.errors import EmbeddedServerError, ServerStartError
from pipeline.tools.harness.binaries import RunAs, find_postgres_bin_dir, resolve_run_as, server_env
from pipeline.tools.harness.hosts import SUBNET, Host
from pipeline.tools.harness.server import STOP_TIMEOUT, EmbeddedServer


class EmbeddedPostgres(EmbeddedServer):
    """A private Postgres on 127.0.0.1 with trust auth, for tests and ``pipeline demo``.

    ``durable=False`` turns off fsync, synchronous_commit and full_page_writes: much faster
    commits, but a :meth:`kill` may then lose acknowledged ones, so crash tests must keep the
    default. ``data_dir`` is used as PGDATA (initdb'd if absent or empty); when
    omitted a temporary one is made and :meth:`cleanup` deletes it. When running as root the
    server runs as ``run_as`` (default ``pipelinepg``), which must be able to reach data_dir.
    """

    initdb_cache: ClassVar[Path | None] = None
    """When set, initdb runs once per set of binaries into this directory and each new data
    directory is a copy of that cluster: initdb and its fsyncs take seconds, a copy a few
    milliseconds. For callers that start many servers (the test suite sets it per session);
    the copy is a fresh cluster like any other, and the directory is the caller's to delete.
    """

    _kind = "Postgres"
    _stop_signal = signal.SIGINT  # "fast" shutdown: abort sessions, checkpoint, exit
    _log_name = "postgres.log"

    def __init__(
        self,
        data_dir: Path | None = None,
        port: int | None = None,
        *,
        durable: bool = True,
        bin_dir: Path | None = None,
        run_as: str | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = STOP_TIMEOUT,
        host: Host | None = None,
    ) -> None:
        super().__init__(data_dir, port, start_timeout, stop_timeout, host)
        self.durable = durable
        self._bin_dir_override = bin_dir
        self._run_as_name = run_as
        self._run_as: RunAs | None = None
        self._bin_dir: Path | None = None
        self._socket_dir: Path | None = None

    @property
    def url(self) -> str:
        return self.dsn("postgres")

    def dsn(self, dbname: str) -> str:
        """Connection URL for another database on this server (it must already exist)."""
        return f"postgresql://postgres@{self.address}:{self.port}/{dbname}"

    @property
    def socket_dir(self) -> Path | None:
        """Directory of the unix socket while running (private: mode 0700)."""
        return self._socket_dir

    @property
    def bin_dir(self) -> Path | None:
        """Directory the binaries were taken from, once started."""
        return self._bin_dir

    def _prepare(self) -> None:
        if self._bin_dir is None:
            self._run_as = resolve_run_as(self._run_as_name)
            self._bin_dir = find_postgres_bin_dir(self._bin_dir_override, self._run_as)
        data = self._data_dir
        if self._owns_data_dir:
            data.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not (data / "PG_VERSION").exists():
            if data.exists() and any(data.iterdir()):
                raise EmbeddedServerError(
                    f"{data} is not empty but is not a Postgres data directory (no PG_VERSION); "
                    "point data_dir at an empty or missing directory"
                )
            self._initdb()
        if self.host is not None:
            self._trust_hosts()
        if self._socket_dir is None:
            # Outside the data dir: unix socket paths are limited to ~100 bytes.
            self._socket_dir = Path(tempfile.mkdtemp(prefix="pipeline-pgsock-"))
            self._chown(self._socket_dir)

    def _trust_hosts(self) -> None:
        """On a host of a :class:`~pipeline.tools.harness.hosts.HostNetwork`, trust the other
        hosts as initdb's ``--auth=trust`` trusts 127.0.0.1 (the network is this machine's)."""
        hba = self._data_dir / "pg_hba.conf"
        line = f"host all all {SUBNET} trust\n"
        text = hba.read_text()
        if line not in text:
            hba.write_text(text + line)

    def _initdb(self) -> None:
        assert self._bin_dir is not None
        cache = self.initdb_cache
        if cache is None:
            self._run_initdb(self._data_dir)
        else:
            key = hashlib.sha256(str(self._bin_dir).encode()).hexdigest()[:16]
            template = cache / f"pgdata-{key}"
            if not (template / "PG_VERSION").exists():
                shutil.rmtree(template, ignore_errors=True)  # a half-made one
                self._run_initdb(template)
            self._copy_cluster(template, self._data_dir)
        self.log_path.touch()
        self._chown(self.log_path)

    def _copy_cluster(self, template: Path, data: Path) -> None:
        shutil.copytree(template, data, dirs_exist_ok=True)
        data.chmod(0o700)
        for path in [data, *data.rglob("*")]:
            self._chown(path)

    def _run_initdb(self, data: Path) -> None:
        assert self._bin_dir is not None
        data.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._chown(data)
        command = [
            str(self._bin_dir / "initdb"),
            "-D",
            str(data),
            "--username=postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
        ]
        if not self.durable:
            command.append("--no-sync")
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=server_env(),
            cwd=data,
            **self._popen_kwargs(),
        )
        if result.returncode != 0:
            output = (result.stdout + result.stderr).strip().splitlines()[-25:]
            hint = ""
            if self._run_as is not None:
                hint = f" (it runs as {self._run_as.name!r}, which must be able to reach the dir)"
            raise ServerStartError(
                f"initdb failed with code {result.returncode} for {data}{hint}:\n"
                + "\n".join(output)
            )

    def _command(self) -> list[str]:
        assert self._bin_dir is not None and self._socket_dir is not None
        flag = "on" if self.durable else "off"
        settings = {
            "listen_addresses": self.address,
            "unix_socket_directories": str(self._socket_dir),
            "max_connections": "200",
            "shared_buffers": "128MB",
            "fsync": flag,
            "synchronous_commit": flag,
            "full_page_writes": flag,
            "logging_collector": "off",  # stderr goes to our log file
        }
        command = [str(self._bin_dir / "postgres"), "-D", str(self._data_dir), "-p", str(self.port)]
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        return command

    def _popen_kwargs(self) -> dict[str, Any]:
        return self._run_as.popen_kwargs() if self._run_as is not None else {}

    def _ready(self, pid: int) -> bool:
        # postmaster.pid says "ready" only after recovery, and naming our pid proves the
        # port is ours: a connect alone could reach whoever won a free_port() race.
        try:
            lines = (self._data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        if len(lines) < 8 or lines[0].strip() != str(pid) or lines[7].strip() != "ready":
            return False
        import psycopg

        try:
            psycopg.connect(self.url, connect_timeout=2, autocommit=True).close()
        except psycopg.OperationalError:
            return False
        return True

    def _owned_paths(self) -> list[Path]:
        socket_dir = [self._socket_dir] if self._socket_dir is not None else []
        return [*super()._owned_paths(), *socket_dir]

    def _after_exit(self) -> None:
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def _chown(self, path: Path) -> None:
        if self._run_as is not None:
            os.chown(path, self._run_as.uid, self._run_as.gid)
