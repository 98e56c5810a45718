"""The relay and worker processes ``pipeline demo`` runs, and how they are stopped.

They run in their own sessions: a Ctrl-C in the terminal reaches only the demo, which
then stops them itself: SIGTERM to all at once, a bounded wait, then SIGKILL of each
whole process group (a worker's dramatiq processes included). Should the demo die
without stopping them, they get SIGTERM from the kernel (``PR_SET_PDEATHSIG``, where
it can be set) and SIGKILL from the demo's watchdog.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.childprocess import die_with_parent
from pipeline.config import Settings
from pipeline.errors import DemoError

STOP_GRACE_SECONDS = 5.0
WORKER_READY_LINE = "Worker process is ready for action"


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(host: str, preferred: int) -> int:
    """``preferred`` if it is free (stable for a local Prometheus), else any free port."""
    if preferred and port_is_free(host, preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ChildProcess:
    """A ``pipeline relay`` / ``pipeline worker`` child, its log, and how to stop it."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] = field(repr=False)

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> ChildProcess:
        log = log_path.open("ab")
        # prctl in a pre-exec hook is only safe while this process has a single thread.
        single = sys.platform.startswith("linux") and threading.active_count() == 1
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if single else None,  # noqa: PLW1509 - see above
            )
        except OSError as exc:
            log.close()
            raise DemoError(f"cannot start the {name}: {exc}") from None
        return cls(name, process, log_path, log)

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 1) -> str:
        try:
            text = self.log_path.read_text("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text[-lines:])

    def died(self) -> DemoError:
        tail = self.log_tail()
        detail = f": {tail}" if tail else ""
        return DemoError(f"the {self.name} exited with code {self.process.returncode}{detail}")

    def terminate(self) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its session's group: all children

    def wait_stopped(self, seconds: Callable[[], float]) -> None:
        """Wait for a clean exit while ``seconds()`` allows, then kill the whole group."""
        while self.running() and seconds() > 0:
            time.sleep(0.05)
        self.kill()  # also reaps grandchildren that outlived a clean exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self._log.close()


def stop_all(children: list[ChildProcess], remaining: Callable[[float], float]) -> None:
    """SIGTERM every child at once, then wait for each within one shared grace period.

    ``remaining(cap)`` is the cleanup's budget: the wait ends at the grace period, the
    budget's end or a second Ctrl-C, whichever comes first.
    """
    for child in children:
        child.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS

    def seconds() -> float:
        return remaining(deadline - time.monotonic())

    for child in children:
        child.wait_stopped(seconds)


def count_in_file(path: Path, needle: str) -> int:
    try:
        return path.read_text("utf-8", "replace").count(needle)
    except OSError:
        return 0


@dataclass
class Pipeline:
    """The relay and workers of one demo run, and where their metrics are served."""

    relay: ChildProcess
    workers: ChildProcess
    endpoints: dict[str, str]
    metrics_dir: Path

    @property
    def children(self) -> list[ChildProcess]:
        return [self.relay, self.workers]


def start_pipeline(
    settings: Settings,
    log_dir: Path,
    extra_env: dict[str, str],
    processes: int,
    threads: int,
    on_started: Callable[[ChildProcess], None],
) -> Pipeline:
    """Start ``pipeline relay`` and ``pipeline worker`` on the demo's settings.

    ``on_started`` is called with each child the moment it exists, so that it is stopped
    again even if the next one fails to start.
    """
    host = settings.metrics_host
    relay_port = choose_port(host, settings.metrics_port)
    worker_port = choose_port(host, settings.worker_metrics_port)
    if worker_port == relay_port:
        worker_port = choose_port(host, 0)
    metrics_dir = log_dir / "worker-metrics"
    metrics_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        PIPELINE_DATABASE_URL=settings.require_database_url(),
        PIPELINE_REDIS_URL=settings.require_redis_url(),
        PIPELINE_SCHEMA_NAME=settings.schema_name,
        PIPELINE_REDIS_NAMESPACE=settings.redis_namespace,
        PIPELINE_APP_MODULES=settings.app_modules,
    )
    env.update(extra_env)
    cli = [sys.executable, "-m", "pipeline.tools.cli"]
    relay_argv = [*cli, "relay", "--metrics-port", str(relay_port)]
    relay = ChildProcess.start("relay", relay_argv, env, log_dir / "relay.log")
    on_started(relay)
    worker_env = {**env, "PIPELINE_METRICS_MULTIPROC_DIR": str(metrics_dir)}
    worker_argv = [
        *cli, "worker", "--processes", str(processes),
        "--threads", str(threads), "--metrics-port", str(worker_port),
    ]  # fmt: skip
    workers = ChildProcess.start("workers", worker_argv, worker_env, log_dir / "worker.log")
    on_started(workers)
    endpoints = {
        "relay metrics": f"http://{host}:{relay_port}/metrics",
        "worker metrics": f"http://{host}:{worker_port}/metrics",
    }
    return Pipeline(relay, workers, endpoints, metrics_dir)
