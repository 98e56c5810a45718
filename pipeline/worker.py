"""Dramatiq entry module: ``dramatiq pipeline.worker`` (or ``pipeline worker``).

Dramatiq imports this module in each worker process; building the runtime here is
this module's purpose, so it is the one place that reads settings at import time.
"""

from __future__ import annotations

from typing import Any

from dramatiq.middleware import Middleware

from pipeline.config import get_settings
from pipeline.heartbeat import WorkerHeartbeat
from pipeline.observability.logging import configure_logging
from pipeline.observability.metrics import zero_initialise_inbox, zero_initialise_publishing
from pipeline.observability.tracing import configure_tracing, shutdown_tracing
from pipeline.runtime import build_runtime
from pipeline.signing import REASONS as REFUSALS


class FlushTraces(Middleware):
    """Export the spans still queued when the worker process stops.

    Dramatiq's worker processes are multiprocessing children, which end without running
    ``atexit`` handlers, where the SDK's provider would otherwise flush them: the spans
    of the last few seconds before a stop would be lost.
    """

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        shutdown_tracing()


settings = get_settings()
runtime = build_runtime(settings)
_served = [s for s in runtime.registry.all() if s.handler is not None]
zero_initialise_inbox([s.consumer for s in _served], [s.queue for s in _served], REFUSALS)
zero_initialise_publishing(runtime.registry.event_types(), settings.transport_name)
broker = runtime.broker
configure_tracing(settings, "pipeline-worker")
broker.add_middleware(FlushTraces())
broker.add_middleware(WorkerHeartbeat(settings))
configure_logging(settings)
