"""What the long-running commands (``relay``, ``worker``) share: signals and the checks
they make before they start."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pipeline.config import Settings


def check_database(settings: Settings, grants: Mapping[str, frozenset[str]], command: str) -> None:
    """Fail fast, with one clear line, on a bad URL, a down server or a missing grant."""
    from pipeline.db.connect import connect
    from pipeline.db.privileges import require_privileges

    with connect(settings) as conn:
        require_privileges(conn, settings.schema_name, grants, command)


def stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` (a graceful stop, exit code 0)."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop())
