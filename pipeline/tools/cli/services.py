"""What the long-running commands (``relay``, ``worker``) share: how signals stop them, and
the warning about unknown PIPELINE_* variables.

Their start-up checks (servers, schema, grants) are :func:`pipeline.readiness.wait_for_services`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import Settings
    from pipeline.registry import Registry


def check_routes(settings: Settings, registry: Registry, command: str) -> dict[str, int]:
    """Refuse (one clear line) to publish events waiting for types no consumer takes, unless
    ``settings.allow_unrouted``; returns those types with their counts."""
    from pipeline.db.connect import connect
    from pipeline.relay.routing import check_routes as check

    with connect(settings, autocommit=True) as conn:
        return check(conn, settings, registry, command)


def warn_unknown_variables(role: str) -> None:
    """Log one warning naming each unknown PIPELINE_* variable (a typo changes nothing)."""
    import logging

    from pipeline.config import unknown_variables_warning

    warning = unknown_variables_warning()
    if warning is not None:
        logging.getLogger(f"pipeline.{role}").warning(f"{role}: {warning}")


def stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` (a graceful stop, exit code 0)."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop())
