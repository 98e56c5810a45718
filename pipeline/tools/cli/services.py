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


def routes_check(
    settings: Settings, registry: Registry, command: str, found: dict[str, int]
) -> Callable[[], str | None]:
    """A start-up check for :func:`pipeline.readiness.wait_for_services`: refuse (one clear
    line) to publish events waiting for types no consumer takes, unless
    ``settings.allow_unrouted``; those types and counts go into ``found``. A connection that
    fails is an outage to wait out, like the other start-up checks."""

    def check() -> str | None:
        import psycopg

        from pipeline.db.connect import connect, describe_server, driver_reason
        from pipeline.errors import ServiceUnavailableError
        from pipeline.readiness import CHECK_TIMEOUT
        from pipeline.relay.routing import check_routes

        try:
            with connect(settings, autocommit=True, connect_timeout=CHECK_TIMEOUT) as conn:
                found.update(check_routes(conn, settings, registry, command))
        except ServiceUnavailableError as exc:
            return str(exc)
        except psycopg.OperationalError as exc:
            url = settings.require_database_url()
            return f"cannot use Postgres at {describe_server(url)}: {driver_reason(exc, url)}"
        return None

    return check


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
