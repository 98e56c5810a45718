"""Prune impact: producers' commit latency while the janitor deletes a large backlog.

A durable Postgres (fsync on; started by the script unless ``--database-url`` is given)
gets ``--rows`` sent outbox events (1,000,000 by default) and as many processed inbox
rows, all older than their retention. Then, with the same producers (the real API:
``add_event`` in a SQLAlchemy ``Session``, one business row and one event per
transaction, ``--clients`` threads over spawned processes, a busy relay faked so that
commits do not NOTIFY, as under load):

* ``baseline``: producers alone for ``--duration`` seconds;
* ``during_prune``: producers while one retention pass (:class:`Pruner`, the janitor's
  code, batches of ``--batch-size``) deletes every expired row; measured over the pass;
* ``after``: producers alone again (the noise between two quiet windows).

Reported: producer commits/s, transaction and commit latency p50/p99 per phase, and the
prune's duration and rows/s. The machine is shared and noisy: compare phases of one run.

Usage: ``python benchmarks/prune_impact.py [--rows 1000000] [--clients 8]
[--duration 20] [--batch-size 5000] [--pause 0] [--output benchmarks/results/prune_impact.json]``
"""

from __future__ import annotations

import argparse
import array
import datetime as dt
import json
import multiprocessing as mp
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from pydantic import SecretStr

from benchmarks import producer_cost as pc
from benchmarks.end_to_end import durability
from pipeline.config import Settings, configure
from pipeline.db.retention import Pruner, PruneResult, RetentionPolicy
from pipeline.tools.harness.embedded import EmbeddedPostgres

SCHEMA = "pipeline"
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "prune_impact.json"
RETENTION_SECONDS = 24 * 3600  # the seeded rows are two days old


def seed(url: str, rows: int, chunk: int = 250_000) -> float:
    """``rows`` sent events to consumer ``e2e`` and their processed inbox rows, two days old.

    Ids increase like UUIDv7s do (time-ordered), as the producer's are. Returns seconds.
    """
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for low in range(0, rows, chunk):
            high = min(rows, low + chunk)
            with conn.transaction():
                conn.execute(
                    "INSERT INTO pipeline.outbox (id, event_type, payload, headers, status, "
                    "attempts, created_at, published_at, consumers) "
                    "SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid, "
                    '\'bench.e2e\', \'{"n": 1, "note": "benchmark"}\', '
                    "'{\"correlation_id\": \"x\"}', 'sent', 1, "
                    "now() - interval '2 days' + i * interval '1 millisecond', "
                    "now() - interval '2 days' + i * interval '1 millisecond', ARRAY['e2e'] "
                    "FROM generate_series(%s::bigint, %s::bigint) AS i",
                    (low, high - 1),
                )
                conn.execute(
                    "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status, "
                    "attempts, received_at, processed_at, delivered_at) "
                    "SELECT 'e2e', ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid, "
                    "'bench.e2e', 'processed', 1, "
                    "now() - interval '2 days' + i * interval '1 millisecond', "
                    "now() - interval '2 days' + i * interval '1 millisecond', "
                    "now() - interval '2 days' + i * interval '1 millisecond' "
                    "FROM generate_series(%s::bigint, %s::bigint) AS i",
                    (low, high - 1),
                )
        conn.execute("VACUUM ANALYZE pipeline.outbox, pipeline.inbox")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


class Producers:
    """The producer_cost benchmark's producer processes, started once, measured by window."""

    def __init__(self, url: str, clients: int, max_processes: int) -> None:
        ctx = mp.get_context("spawn")
        self.go, self.stop = ctx.Event(), ctx.Event()
        ready, self.results = ctx.Queue(), ctx.Queue()
        split = pc._split(clients, max_processes)
        self.processes = [
            ctx.Process(
                target=pc.worker_main,
                args=(
                    pc.WorkerSpec(url, SCHEMA, "outbox_relay_busy", n, size),
                    self.go,
                    self.stop,
                    ready,
                    self.results,
                ),
                daemon=True,
            )
            for n, size in enumerate(split)
        ]
        for process in self.processes:
            process.start()
        for _ in self.processes:
            index, error = ready.get(timeout=120)
            if error is not None:
                raise RuntimeError(f"producer process {index} failed to start: {error}")

    def run(self) -> None:
        self.go.set()

    def finish(self) -> tuple[array.array[float], array.array[float], array.array[float], int]:
        self.stop.set()
        ends, tx_lat, commit_lat = array.array("d"), array.array("d"), array.array("d")
        errors = 0
        for _ in self.processes:
            part = self.results.get(timeout=120)
            ends.frombytes(part["ends"])
            tx_lat.frombytes(part["tx_lat"])
            commit_lat.frombytes(part["commit_lat"])
            errors += len(part["errors"])
        for process in self.processes:
            process.join(timeout=30)
        return ends, tx_lat, commit_lat, errors


def window(
    ends: Sequence[float],
    tx_lat: Sequence[float],
    commit_lat: Sequence[float],
    start: float,
    end: float,
) -> dict[str, Any]:
    inside = [i for i, t in enumerate(ends) if start <= t < end]
    tx = [tx_lat[i] for i in inside]
    commit = [commit_lat[i] for i in inside]
    return {
        "seconds": round(end - start, 2),
        "commits": len(inside),
        "tx_per_s": round(len(inside) / max(end - start, 1e-9), 1),
        "latency_ms": {
            "tx_p50": pc._ms(pc._percentile(tx, 0.50)),
            "tx_p99": pc._ms(pc._percentile(tx, 0.99)),
            "commit_p50": pc._ms(pc._percentile(commit, 0.50)),
            "commit_p99": pc._ms(pc._percentile(commit, 0.99)),
        },
    }


def prune_in_thread(
    url: str, batch_size: int, pause: float, out: dict[str, Any], done: threading.Event
) -> threading.Thread:
    policy = RetentionPolicy(
        outbox=RETENTION_SECONDS,
        inbox=RETENTION_SECONDS,
        attempts=RETENTION_SECONDS,
        audit_log=RETENTION_SECONDS,
        batch_size=batch_size,
    )

    def run() -> None:
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                out["started"] = time.monotonic()
                result: PruneResult = Pruner(SCHEMA, policy, pause=pause).run(conn)
                out["ended"] = time.monotonic()
                out["result"] = result.as_json()
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--duration", type=float, default=20.0, help="baseline/after seconds")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between batches")
    parser.add_argument("--database-url")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    started_at = dt.datetime.now(dt.UTC)
    machine = pc._machine()
    server: EmbeddedPostgres | None = None
    url = args.database_url
    if url is None:
        server = EmbeddedPostgres(durable=True)
        server.start()
        url = server.url
    try:
        configure(Settings(database_url=SecretStr(url), schema_name=SCHEMA))
        bench = pc.Bench(url, SCHEMA)
        bench.migrate()
        print(f"seeding {args.rows} outbox and inbox rows...", flush=True)
        seeded = seed(url, args.rows)
        print(f"  {seeded:.0f}s", flush=True)
        heartbeat = pc.Heartbeat(url, SCHEMA)
        producers = Producers(url, args.clients, args.processes)
        try:
            producers.run()
            time.sleep(pc.WARMUP_SECONDS)
            base_start = time.monotonic()
            time.sleep(args.duration)
            base_end = time.monotonic()
            out: dict[str, Any] = {}
            done = threading.Event()
            thread = prune_in_thread(url, args.batch_size, args.pause, out, done)
            done.wait(timeout=1800)
            thread.join(timeout=60)
            after_start = time.monotonic()
            time.sleep(args.duration)
            after_end = time.monotonic()
            ends, tx_lat, commit_lat, errors = producers.finish()
        finally:
            heartbeat.close()
        if "result" not in out:
            raise SystemExit("the prune did not finish")
        phases = {
            "baseline": window(ends, tx_lat, commit_lat, base_start, base_end),
            "during_prune": window(ends, tx_lat, commit_lat, out["started"], out["ended"]),
            "after": window(ends, tx_lat, commit_lat, after_start, after_end),
        }
        prune_seconds = out["ended"] - out["started"]
        deleted = out["result"]["deleted"]
        report = {
            "benchmark": "prune_impact",
            "date": started_at.isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv] if argv is None else [*argv]),
            "machine": machine,
            "code": pc._code_version(),
            "durability": durability(url),
            "database": "embedded (EmbeddedPostgres durable=True)" if server else "external",
            "note": "shared 2-core machine: other work ran at the same time; compare phases",
            "parameters": {
                "rows": args.rows,
                "clients": args.clients,
                "processes": args.processes,
                "duration_s": args.duration,
                "batch_size": args.batch_size,
                "pause_s": args.pause,
                "producer_mode": "outbox_relay_busy (no NOTIFY), one business row + one event",
            },
            "seed_seconds": round(seeded, 1),
            "prune": {
                "seconds": round(prune_seconds, 2),
                "deleted": deleted,
                "rows_per_s": round(deleted / max(prune_seconds, 1e-9)),
                "tables": out["result"]["tables"],
            },
            "producers": phases,
            "producer_errors": errors,
            "p99_commit_ratio_during_to_baseline": (
                round(
                    phases["during_prune"]["latency_ms"]["commit_p99"]
                    / phases["baseline"]["latency_ms"]["commit_p99"],
                    2,
                )
                if phases["baseline"]["latency_ms"]["commit_p99"]
                and phases["during_prune"]["latency_ms"]["commit_p99"]
                else None
            ),
        }
        bench.close()
    finally:
        if server is not None:
            server.cleanup()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("prune", "producers")}, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
