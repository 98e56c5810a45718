"""End-to-end throughput with millions of retained rows in the tables against empty tables.

The tables grow to whatever retention keeps: at 1,000 events/s a week of sent events is
600 million rows. This measures what full tables cost the whole path (producer insert,
relay claim and mark-sent, inbox claim and handler, the janitor scanning for work): the
same closed-loop run as ``benchmarks/end_to_end.py``'s ``throughput`` (its relay, its
worker processes and its consumer), once on empty tables and once with ``--rows``
(5,000,000 by default) sent outbox events and processed inbox rows, all younger than
their retention, with the relay's janitor running every ``--prune-interval`` seconds —
the steady state once the janitor has caught up (nothing expired left to delete).

Durable Postgres (fsync on) and Redis are started by the script unless URLs are given.
The machine is shared: compare rounds of one run (``--rounds`` alternates the two).

Usage: ``python benchmarks/retention_throughput.py [--rows 5000000] [--duration 15]
[--rounds 2] [--output benchmarks/results/retention_throughput.json]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text

from benchmarks import end_to_end as e2e
from benchmarks import producer_cost as pc
from pipeline.config import Settings, configure
from pipeline.db.migrate import upgrade

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "retention_throughput.json"
TABLES = "pipeline.outbox, pipeline.inbox, pipeline.attempts, pipeline.dead_letters"


def empty(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE bench_e2e, {TABLES}")
        conn.execute("VACUUM ANALYZE pipeline.outbox, pipeline.inbox")
        conn.execute("CHECKPOINT")


def fill(url: str, rows: int, chunk: int = 500_000) -> float:
    """``rows`` sent events to consumer ``e2e`` and their processed inbox rows, one hour old
    (within every retention). Ids increase as UUIDv7s do. Returns seconds taken."""
    started = time.perf_counter()
    empty(url)
    uid = "('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid"
    at = "now() - interval '1 hour' + i * interval '500 microseconds'"
    with psycopg.connect(url, autocommit=True) as conn:
        for low in range(0, rows, chunk):
            high = min(rows, low + chunk) - 1
            with conn.transaction():
                conn.execute(
                    "INSERT INTO pipeline.outbox (id, event_type, payload, headers, status, "
                    "attempts, created_at, published_at, consumers) "
                    f'SELECT {uid}, \'bench.e2e\', \'{{"n": 1, "note": "benchmark"}}\', '
                    f"'{{\"correlation_id\": \"x\"}}', 'sent', 1, {at}, {at}, ARRAY['e2e'] "
                    "FROM generate_series(%s::bigint, %s::bigint) AS i",
                    (low, high),
                )
                conn.execute(
                    "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status, "
                    "attempts, received_at, processed_at, delivered_at) "
                    f"SELECT 'e2e', {uid}, 'bench.e2e', 'processed', 1, {at}, {at}, {at} "
                    "FROM generate_series(%s::bigint, %s::bigint) AS i",
                    (low, high),
                )
            print(f"  {high + 1} rows", flush=True)
        conn.execute("VACUUM ANALYZE pipeline.outbox, pipeline.inbox")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def throughput(
    env: dict[str, str], url: str, engine: Any, duration: float, producers: int
) -> dict[str, Any]:
    """end_to_end's closed-loop throughput, without its truncation of the pipeline tables."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE bench_e2e"))
    probe = e2e.speed_probe_ms()  # the machine's speed now: a neighbour's load shows here
    busy = e2e.machine_busy_seconds()
    started = time.time()
    committed, _ = e2e.run_producers(env, url, "closed", duration, producers)
    ended = time.time()
    done = e2e.wait_processed(engine, list(committed), timeout=180)
    busy = e2e.machine_busy_seconds() - busy
    window_start, window_end = started + 2, ended
    in_window = sum(1 for d in done.values() if window_start <= d <= window_end)
    finished = max(done.values(), default=ended)
    return {
        "committed": len(committed),
        "processed": len(done),
        "commit_rate": round(len(committed) / (ended - started), 1),
        "processed_per_s_in_window": round(in_window / (window_end - window_start), 1),
        "end_to_end_per_s": round(len(done) / (finished - started), 1),
        "speed_probe_ms": probe,
        "machine_cpu_ms_per_event": round(busy * 1000 / max(len(done), 1), 3),
    }


def table_rows(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return {
            table: int(conn.execute(f"SELECT count(*) FROM pipeline.{table}").fetchone()[0])
            for table in ("outbox", "inbox")
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="empty/full pairs to run")
    parser.add_argument("--prune-interval", type=float, default=10.0)
    parser.add_argument("--worker-processes", type=int, default=2)
    parser.add_argument("--worker-threads", type=int, default=8)
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    started_at = dt.datetime.now(dt.UTC)
    machine = pc._machine()
    logs = Path(tempfile.mkdtemp(prefix="pipeline-retention-logs-"))
    rounds: list[dict[str, Any]] = []
    with e2e.servers(args.database_url, args.redis_url) as (database_url, redis_url):
        settings = Settings(database_url=database_url, redis_url=redis_url)  # type: ignore[arg-type]
        configure(settings)
        engine = create_engine(settings.sqlalchemy_url(), pool_size=4)
        with engine.begin() as conn:
            upgrade(conn, settings.schema_name)
            conn.execute(
                text(
                    "CREATE TABLE IF NOT EXISTS bench_e2e"
                    " (event_id uuid PRIMARY KEY, done_at float8)"
                )
            )
        env = e2e.observability_env("default", e2e.OtlpSink(), 0.1)
        env["PIPELINE_PRUNE_INTERVAL_SECONDS"] = str(args.prune_interval)
        for number in range(args.rounds):
            for scenario in ("empty", "full"):
                print(f"round {number + 1}: {scenario}", flush=True)
                if scenario == "empty":
                    empty(database_url)
                fill_seconds = fill(database_url, args.rows) if scenario == "full" else 0.0
                before = table_rows(database_url)
                pipeline = e2e.Pipeline(
                    settings,
                    args.worker_processes,
                    args.worker_threads,
                    logs / f"{scenario}-{number}",
                    env,
                )
                try:
                    warm = e2e.open_loop(engine, 200, e2e.WARM_UP_SECONDS, 2)
                    if len(e2e.wait_processed(engine, list(warm), timeout=120)) != len(warm):
                        raise SystemExit(f"warm-up events were not processed; see {logs}")
                    result = throughput(env, database_url, engine, args.duration, args.producers)
                finally:
                    pipeline.stop()
                result.update(
                    scenario=scenario,
                    round=number + 1,
                    rows_before=before,
                    fill_seconds=round(fill_seconds, 1),
                )
                print(f"  {json.dumps(result)}", flush=True)
                rounds.append(result)
        engine.dispose()
        durability = e2e.durability(database_url)
    ratios = [
        round(full["processed_per_s_in_window"] / empty_["processed_per_s_in_window"], 3)
        for empty_, full in zip(rounds[::2], rounds[1::2], strict=True)
        if empty_["processed_per_s_in_window"]
    ]
    report = {
        "benchmark": "retention_throughput",
        "date": started_at.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv] if argv is None else [*argv]),
        "machine": machine,
        "code": pc._code_version(),
        "durability": durability,
        "note": "shared 2-core machine: other work ran at the same time; compare one round",
        "setup": {
            "relay": "1 process, --mode auto, janitor every "
            f"{args.prune_interval:g}s (nothing expired: it scans and finds no work)",
            "workers": f"{args.worker_processes} processes x {args.worker_threads} threads",
            "producers": f"{args.producers} threads, closed loop, one event per transaction",
            "full_tables": f"{args.rows} sent outbox events + {args.rows} processed inbox rows",
            "logs": str(logs),
        },
        "rounds": rounds,
        "full_to_empty_throughput_ratios": ratios,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"rounds": rounds, "ratios": ratios}, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
