"""What the long-running commands (``relay``, ``worker``) share: how signals stop them, and
the warning about unknown PIPELINE_* variables.

Their start-up checks (servers, schema, grants) are :func:`pipeline.readiness.wait_for_services`.
"""

from __future__ import annotations

from collections.abc import Callable


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
