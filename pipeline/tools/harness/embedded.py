"""Throwaway local Postgres and Redis servers for tests, fault injection and ``pipeline demo``.

The outbox's guarantees (commit visibility, crash recovery, redelivery) only mean
something against real servers, so these are the real binaries, not fakes
(:mod:`pipeline.tools.harness.binaries` says where they come from). Each server lives in its
own session, is stopped by :meth:`~EmbeddedServer.cleanup` (or ``with``), and dies with
the process that started it even when that process is SIGKILLed
(:mod:`pipeline.tools.harness.watchdog`). Nothing is registered globally and importing this
module has no side effects.

This module is the import path for users of the servers; the code lives in
:mod:`~pipeline.tools.harness.server` (the process lifecycle),
:mod:`~pipeline.tools.harness.postgres_server` and :mod:`~pipeline.tools.harness.redis_server`.
"""

from __future__ import annotations

from pipeline.errors import BinaryNotFoundError, EmbeddedServerError, ServerStartError
from pipeline.tools.harness.postgres_server import EmbeddedPostgres
from pipeline.tools.harness.redis_server import EmbeddedRedis
from pipeline.tools.harness.server import EmbeddedServer, free_port

__all__ = [
    "BinaryNotFoundError",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "EmbeddedServer",
    "EmbeddedServerError",
    "ServerStartError",
    "free_port",
]
