"""What the long-running commands (``relay``, ``worker``) share: how signals stop them.

Their start-up checks (servers, schema, grants) are :func:`pipeline.readiness.wait_for_services`.
"""

from __future__ import annotations

from collections.abc import Callable


def stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` (a graceful stop, exit code 0)."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop())
