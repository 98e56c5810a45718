"""Routes for the relay process of ``benchmarks/relay.py``: consumer ``bench`` takes order.placed.

Loaded by ``python -m pipeline.tools.cli relay`` through ``PIPELINE_APP_MODULES=bench_app``
(with this directory on ``PYTHONPATH``). It registers a route only, no handler: the
benchmark measures publishing, so nothing consumes the ``pipeline.bench`` queue.
"""

from __future__ import annotations

from pipeline.registry import registry

BENCH_CONSUMER = "bench"
BENCH_EVENT_TYPE = "order.placed"

registry.subscribe(BENCH_CONSUMER, [BENCH_EVENT_TYPE])
