"""Dramatiq entry module: ``dramatiq pipeline.worker`` (or ``pipeline worker``).

Dramatiq imports this module in each worker process; building the runtime here is
this module's purpose, so it is the one place that reads settings at import time.
"""

from __future__ import annotations

from pipeline.config import get_settings
from pipeline.runtime import build_runtime

runtime = build_runtime(get_settings())
broker = runtime.broker
