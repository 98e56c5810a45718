"""The relay and worker processes ``pipeline demo`` runs.

They are children of the demo's :class:`~pipeline.tools.harness.fleet.Fleet`: each in a
session of its own (a Ctrl-C in the terminal reaches only the demo, which then stops
them itself), and killed with their own children by the fleet's watchdog should the
demo die without stopping them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Settings
from pipeline.errors import DemoError
from pipeline.tools.harness.commands import relay_command, worker_command
from pipeline.tools.harness.fleet import Child, Fleet

STOP_GRACE_SECONDS = 5.0


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


def died(child: Child) -> DemoError:
    """The error for a relay or workers that exited while the demo needed them."""
    tail = child.log_tail()
    detail = f": {tail}" if tail else ""
    return DemoError(f"the {child.name} exited with code {child.returncode}{detail}")


@dataclass
class Pipeline:
    """The relay and workers of one demo run, and where their metrics are served."""

    relay: Child
    workers: Child
    endpoints: dict[str, str]
    metrics_dir: Path

    @property
    def children(self) -> list[Child]:
        return [self.relay, self.workers]


def start_pipeline(
    fleet: Fleet,
    settings: Settings,
    log_dir: Path,
    extra_env: dict[str, str],
    processes: int,
    threads: int,
    on_started: Callable[[Child], None],
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
    if settings.message_key is not None:
        env["PIPELINE_MESSAGE_KEY"] = settings.message_key.get_secret_value()
    env.update(extra_env)

    def start(name: str, argv: list[str], env: dict[str, str], log: str) -> Child:
        try:
            child = fleet.start(name, argv, env=env, log_path=log_dir / log)
        except OSError as exc:
            raise DemoError(f"cannot start the {name}: {exc}") from None
        on_started(child)
        return child

    relay = start("relay", relay_command(relay_port), env, "relay.log")
    worker_env = {**env, "PIPELINE_METRICS_MULTIPROC_DIR": str(metrics_dir)}
    workers = start(
        "workers", worker_command(processes, threads, worker_port), worker_env, "worker.log"
    )
    endpoints = {
        "relay metrics": f"http://{host}:{relay_port}/metrics",
        "worker metrics": f"http://{host}:{worker_port}/metrics",
    }
    return Pipeline(relay, workers, endpoints, metrics_dir)
