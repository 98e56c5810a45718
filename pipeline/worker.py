"""Dramatiq entry module: ``dramatiq pipeline.worker`` (or ``pipeline worker``).

Dramatiq imports this module in each worker process; building the runtime here is
this module's purpose, so it is the one place that reads settings at import time.
"""

from __future__ import annotations

from pipeline.config import get_settings
from pipeline.observability.logging import configure_logging
from pipeline.observability.tracing import configure_tracing
from pipeline.runtime import build_runtime

settings = get_settings()
runtime = build_runtime(settings)
broker = runtime.broker
configure_tracing(settings, "pipeline-worker")
configure_logging(settings)
