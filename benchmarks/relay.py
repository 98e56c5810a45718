"""Relay benchmark: throughput, wake-up latency, and producer cost with a real relay running.

Three sections (``--only`` picks some), against a real durable Postgres and a real Redis:

* ``throughput``: N committed outbox events (1,000 ordering keys, 2 subscribed consumers)
  are drained by one inline :class:`~pipeline.relay.drain.Drainer` and, separately, by two
  drainer processes in parallel (the relay plus one publishing actor). Reports events
  marked sent per second, Dramatiq messages created per second, where each batch's time
  goes (claim SQL, commits, JSON encoding, Redis round trip, mark-sent) and CPU shares, at
  ``batch_size`` 1, 100 and 1000; then checks every event is ``sent`` and every queue
  holds each event exactly once.
* ``wakeup_latency``: commit -> message visible on the consumer queue, for a
  :class:`~pipeline.relay.relay.Relay` thread woken only by NOTIFY (polls every 5 s),
  one polling without LISTEN (default adaptive polling; paced and idle arrivals), and
  sustained loads (200 and 1,000 events/s offered by producer processes; the relay stays
  busy). Each event's time is also split at the relay's own timestamps (wake, claim,
  deliver, observe), from wrappers set on the relay's instance. The producer records
  ``perf_counter()`` right after ``session.commit()`` returns; an observer thread blocks on
  the publisher's wake-up list, pops the queue and records ``perf_counter()`` when the
  event's id comes back. Producer, relay and observer are threads of this process
  (sustained load: producers are processes; ``perf_counter`` is the system-wide
  CLOCK_MONOTONIC on Linux, so both ends still read one clock).
* ``producer_with_relay``: ``benchmarks/producer_cost.py``'s measurement (its functions,
  imported) for modes ``business`` and ``outbox`` (its ``outbox_notify``: trigger
  installed, no fake heartbeat) while a real ``python -m pipeline.tools.cli relay --mode inline``
  process publishes; counts the NOTIFYs producers sent (a LISTEN from here) and samples
  the relay's busy flag.

The sections live in ``relay_throughput.py``, ``relay_latency.py`` and
``relay_with_producers.py``; what they share in ``relay_context.py`` (servers, events,
checks) and ``relay_instruments.py`` (timing, CPU); the report in ``relay_report.py``.
This module parses the command line, starts the servers and runs the sections.

Usage: ``python benchmarks/relay.py [--only throughput,wakeup_latency,producer_with_relay]
[--output benchmarks/results/relay.json] [--database-url URL] [--redis-url URL]``.
Without URLs it starts ``EmbeddedPostgres(durable=True)`` and ``EmbeddedRedis`` and removes
them afterwards. With a database URL it uses schema ``pipeline_bench`` (it TRUNCATEs it);
with a Redis URL a private key namespace that it deletes afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/relay.py: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import datetime as dt
import os
import shlex
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import dramatiq
import redis
from psycopg import sql
from pydantic import SecretStr

from benchmarks import producer_cost as pc
from benchmarks.relay_context import TEMPLATE, Context
from benchmarks.relay_latency import run_wakeup_latency
from benchmarks.relay_report import code_state, print_tables, redis_info, write_report
from benchmarks.relay_throughput import BATCH_SIZES, run_throughput
from benchmarks.relay_with_producers import run_producer_with_relay
from pipeline.config import Settings, configure, libpq_url
from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "relay.json"
SECTIONS = ("throughput", "wakeup_latency", "producer_with_relay")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--database-url", default=os.environ.get("PIPELINE_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("PIPELINE_REDIS_URL"))
    parser.add_argument("--events", type=int, default=50_000, help="throughput, batch >= 100")
    parser.add_argument(
        "--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="throughput batch sizes"
    )
    parser.add_argument("--events-batch1", type=int, default=1_000, help="throughput, batch 1")
    parser.add_argument("--latency-events", type=int, default=300)
    parser.add_argument("--idle-events", type=int, default=8, help="polling_idle case")
    parser.add_argument("--sustained-rates", default="200,1000", help="events/s offered")
    parser.add_argument("--sustained-duration", type=float, default=8.0)
    parser.add_argument("--duration", type=float, default=8.0, help="producer_with_relay run")
    parser.add_argument("--clients", default="1,8,32", help="producer_with_relay clients")
    parser.add_argument("--processes", type=int, default=4, help="max producer processes")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    rates = [float(r) for r in args.sustained_rates.split(",") if r.strip()]

    started_at = dt.datetime.now(dt.UTC)
    machine = pc._machine() | {"dramatiq": dramatiq.__version__, "redis_py": redis.__version__}
    pg_server = EmbeddedPostgres(durable=True) if args.database_url is None else None
    redis_server = EmbeddedRedis() if args.redis_url is None else None
    report: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for server in (pg_server, redis_server):
            if server is not None:
                stack.enter_context(server)  # started now, removed on exit
        url = args.database_url or (pg_server.url if pg_server else "")
        redis_url = args.redis_url or (redis_server.url if redis_server else "")
        schema = "pipeline_bench" if args.database_url else "pipeline"
        namespace = f"relaybench{uuid.uuid4().hex[:8]}" if args.redis_url else "pipeline"
        settings = Settings(
            database_url=SecretStr(libpq_url(url)),
            redis_url=SecretStr(redis_url),
            schema_name=schema,
            redis_namespace=namespace,
        )
        configure(settings)
        bench = pc.Bench(url, schema)
        stack.callback(bench.close)
        stack.callback(bench.admin.execute, sql.SQL("DROP TABLE IF EXISTS {}").format(TEMPLATE))
        client = redis.Redis.from_url(redis_url)
        stack.callback(client.close)
        ctx = Context(
            settings,
            bench,
            pg_server.pid if pg_server else None,
            redis_server.pid if redis_server else None,
            client,
        )
        if args.redis_url:
            stack.callback(ctx.clear_redis)
        bench.migrate()
        server = bench.server_settings()
        disk = (
            {"data_dir": str(pg_server.data_dir), **pc._fsync_probe(pg_server.data_dir.parent)}
            if pg_server
            else None
        )
        print(
            f"Postgres {server['server_version']}: fsync={server['fsync']} "
            f"synchronous_commit={server['synchronous_commit']} "
            f"full_page_writes={server['full_page_writes']}; nproc={machine['nproc']}",
            flush=True,
        )
        report = {
            "benchmark": "relay",
            "date": started_at.isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv] if argv is None else [*argv]),
            "cwd": str(Path.cwd()),
            "parameters": {
                "sections": sections,
                "events": args.events,
                "events_batch1": args.events_batch1,
                "latency_events": args.latency_events,
                "idle_events": args.idle_events,
                "sustained_rates": rates,
                "sustained_duration_s": args.sustained_duration,
                "producer_duration_s": args.duration,
                "clients": clients_list,
                "max_processes": args.processes,
                "schema": schema,
                "database": "embedded (EmbeddedPostgres durable=True)" if pg_server else "external",
                "redis": "embedded (EmbeddedRedis, no persistence)" if redis_server else "external",
                "settings": {
                    k: getattr(settings, k)
                    for k in (
                        "batch_size",
                        "max_events_per_message",
                        "poll_interval_busy",
                        "poll_interval_min",
                        "poll_interval_max",
                        "lease_seconds",
                    )
                },
            },
            "server": server,
            "redis_server": redis_info(client),
            "disk": disk,
            "machine": machine,
            "code": code_state(),
            "complete": False,
        }
        runners: dict[str, Callable[[], dict[str, Any]]] = {
            "throughput": lambda: run_throughput(
                ctx,
                args.events,
                args.events_batch1,
                [int(size) for size in args.batch_sizes.split(",")],
            ),
            "wakeup_latency": lambda: run_wakeup_latency(
                ctx, args.latency_events, args.idle_events, rates, args.sustained_duration
            ),
            "producer_with_relay": lambda: run_producer_with_relay(
                ctx, clients_list, args.duration, args.processes
            ),
        }
        report["loadavg_after_section"] = {}
        for section in SECTIONS:
            if section in sections:
                report[section] = runners[section]()
                report["loadavg_after_section"][section] = os.getloadavg()
                write_report(report, args.output, started_at)  # keep what ran if a later one fails
    report["complete"] = True
    write_report(report, args.output, started_at)
    print_tables(report)
    print(f"\nwrote {args.output} in {report['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
