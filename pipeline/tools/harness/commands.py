"""The ``pipeline relay`` and ``pipeline worker`` command lines the harness runs as children,
and how to tell that a worker is ready."""

from __future__ import annotations

import sys

from pipeline.tools.harness.fleet import Child

CLI = (sys.executable, "-m", "pipeline.tools.cli")
WORKER_READY_LINE = "Worker process is ready for action"  # Dramatiq's, once per process


def relay_command(metrics_port: int, *extra: str) -> list[str]:
    return [*CLI, "relay", "--metrics-port", str(metrics_port), *extra]


def worker_command(processes: int, threads: int, metrics_port: int) -> list[str]:
    return [
        *CLI, "worker", "--processes", str(processes),
        "--threads", str(threads), "--metrics-port", str(metrics_port),
    ]  # fmt: skip


def workers_ready(child: Child, processes: int) -> bool:
    """A ``pipeline worker`` is ready once every one of its Dramatiq processes says so
    (in the log of this start of it: each start has a log of its own)."""
    return child.running() and child.count_in_log(WORKER_READY_LINE) >= processes
