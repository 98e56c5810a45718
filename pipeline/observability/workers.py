"""``pipeline worker``'s metrics: supervise Dramatiq and serve its processes' metrics.

Dramatiq forks its worker processes, so each one writes its metrics to memory-mapped
files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode). The
``pipeline worker`` process therefore does not exec Dramatiq: it prepares that
directory, starts ``dramatiq`` as a child in the same process group (so a kill of the
group still reaches every worker), serves ``/metrics`` as the aggregate of the
directory, forwards SIGTERM and SIGHUP (Dramatiq's reload), and exits with Dramatiq's
exit code.

SIGINT is not forwarded: Ctrl-C in a terminal already reaches the whole process
group, and a second SIGINT would make Dramatiq kill its workers mid-task. Stop a
worker programmatically with SIGTERM. If the parent dies, Linux sends the child
SIGTERM (``PR_SET_PDEATHSIG``) so Dramatiq shuts down gracefully instead of running on
unobserved.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from pipeline.childprocess import die_with_parent
from pipeline.config import Settings
from pipeline.observability.metrics import (
    MULTIPROC_ENV,
    prepare_multiprocess_dir,
    remove_multiprocess_dir,
    start_metrics_server,
)

log = logging.getLogger("pipeline.worker")
FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def run_dramatiq_with_metrics(
    argv: list[str], env: dict[str, str], settings: Settings, port: int | None
) -> int:
    """Run ``argv`` (the dramatiq command) as a child, serving its metrics; returns its code."""
    path = prepare_multiprocess_dir(settings)
    env = {**env, MULTIPROC_ENV: str(path)}
    preexec: Callable[[], None] | None = None
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        preexec = die_with_parent  # only safe while this process has a single thread
    child = subprocess.Popen(argv, env=env, preexec_fn=preexec)  # noqa: PLW1509
    previous = {sig: signal.signal(sig, _forward(child)) for sig in FORWARDED}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = None
    try:
        try:
            server = start_metrics_server(settings, "worker", port=port, multiprocess_path=path)
        except OSError as exc:
            log.error(
                "worker metrics endpoint disabled: cannot listen",
                extra={"host": settings.metrics_host, "error": str(exc)},
            )
        code = child.wait()
    finally:
        if child.poll() is None:  # this process is failing: do not leave Dramatiq behind
            child.terminate()
            child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server is not None:
            server.close()
        remove_multiprocess_dir(Path(path))
    return 128 - code if code < 0 else code


def _forward(child: subprocess.Popen[bytes]) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    return handler
