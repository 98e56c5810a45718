"""A producer whose clock is shifted: ``python -m pipeline.tools.drill.skewed --skew SECONDS``.

Reads planned orders (JSON) on stdin and places them at ``--rate`` per second, like the
drill's main producer, after shifting this process's wall clock by ``--skew`` seconds as
the pipeline's code sees it (``time.time`` and ``time.time_ns``; the monotonic clock is
left alone). The producer's clock reaches the pipeline only through the UUIDv7 event ids
(and the producer's span timestamps); created_at, sequence numbers and ordering come from
Postgres, so events placed here must be delivered in sequence order like any other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _shift_clock(seconds: float) -> None:
    """Shift ``time.time``/``time.time_ns`` before any pipeline module binds them."""
    real_time, real_time_ns = time.time, time.time_ns
    shift_ns = int(seconds * 1_000_000_000)
    time.time = lambda: real_time() + seconds
    time.time_ns = lambda: real_time_ns() + shift_ns


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tools.drill.skewed")
    parser.add_argument("--skew", type=float, required=True, help="seconds added to the clock")
    parser.add_argument("--rate", type=float, default=0.0, help="orders per second (0: no pause)")
    options = parser.parse_args(argv)
    _shift_clock(options.skew)

    from pipeline.config import configure, load_settings
    from pipeline.db.connect import make_engine
    from pipeline.tools.drill.sql import DrillQueries
    from pipeline.tools.drill.workflow import APP_SCHEMA_ENV
    from pipeline.tools.drill.workload import PlannedOrder, place_order
    from pipeline.tools.harness.workload import wait_turn

    orders = [PlannedOrder(**order) for order in json.load(sys.stdin)]
    settings = load_settings()
    configure(settings)
    engine = make_engine(settings, pool_size=1, pool_pre_ping=True)
    queries = DrillQueries(settings.schema_name, os.environ[APP_SCHEMA_ENV])
    name = f"skewed {options.skew:+.0f} s"
    started = time.monotonic()
    try:
        for index, order in enumerate(orders):
            wait_turn(started, index, options.rate)
            place_order(engine, queries, order, name)
    finally:
        engine.dispose()
    print(f"placed {len(orders)} orders with the clock shifted by {options.skew:+.1f} s")


if __name__ == "__main__":
    main()
