"""Backlog limit cost: what ``PIPELINE_BACKLOG_LIMIT`` adds to the producer's path.

Two parts, both too small for an end-to-end run on a shared machine to resolve:

* ``per_call_us``: the check ``add_event*`` makes on every call (no SQL), with the
  limit off and on (the count cached);
* ``count_ms``: the bounded count a producer process runs at most once a second when
  the limit is on, with ``--unsent`` events waiting, for a limit above and below that.

Durable Postgres started by the script unless ``--database-url`` is given (it then uses
and truncates the schema ``pipeline_bench``).

Usage: ``python -m benchmarks.backlog_gate [--unsent 10000,100000]
[--output benchmarks/results/backlog_gate.json]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
import timeit
from collections.abc import Sequence
from pathlib import Path

import psycopg
from pydantic import SecretStr
from sqlalchemy import create_engine

from benchmarks import producer_cost as pc
from benchmarks.end_to_end import durability
from pipeline.config import Settings
from pipeline.db.migrate import upgrade
from pipeline.db.queries import queries_for
from pipeline.outbox import BacklogGate
from pipeline.tools.harness.embedded import EmbeddedPostgres

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "backlog_gate.json"


def per_call_us(limit: int) -> float:
    """Microseconds of the gate's per-call work (``add_events``' check without SQL)."""
    gate = BacklogGate()
    settings = Settings(database_url=SecretStr("postgresql://unused/db"), backlog_limit=limit)
    gate.record(settings, 0)

    def call() -> None:
        if settings.backlog_limit and gate.due(settings):
            raise AssertionError("the count was just recorded")
        gate.check(settings)

    number = 200_000
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def count_ms(url: str, schema: str, unsent: int, limits: Sequence[int]) -> dict[str, float]:
    query = queries_for(schema)["backlog_count"]
    outbox = f'"{schema}".outbox'
    result = {}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {outbox}")
        conn.execute(
            f"INSERT INTO {outbox} (id, event_type, payload) "
            "SELECT gen_random_uuid(), 'bench.gate', '{}' FROM generate_series(1, %s)",
            (unsent,),
        )
        conn.execute(f"VACUUM ANALYZE {outbox}")
        for limit in limits:
            times = []
            for _ in range(9):
                started = time.perf_counter()
                conn.execute(query, {"limit": limit + 1}).fetchone()
                times.append(time.perf_counter() - started)
            result[str(limit)] = round(statistics.median(times) * 1000, 3)
        conn.execute(f"TRUNCATE {outbox}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--unsent", default="10000,100000")
    parser.add_argument("--limits", default="10000,1000000")
    parser.add_argument("--database-url")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    started_at = dt.datetime.now(dt.UTC)
    server: EmbeddedPostgres | None = None
    url = args.database_url
    schema = "pipeline_bench" if url else "pipeline"
    if url is None:
        server = EmbeddedPostgres(durable=True)
        server.start()
        url = server.url
    try:
        engine = create_engine("postgresql+psycopg://" + url.split("://", 1)[1])
        with engine.begin() as connection:
            upgrade(connection, schema)
        engine.dispose()
        limits = [int(v) for v in args.limits.split(",")]
        report = {
            "benchmark": "backlog_gate",
            "date": started_at.isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv] if argv is None else [*argv]),
            "machine": pc._machine(),
            "code": pc._code_version(),
            "durability": durability(url),
            "per_call_us": {
                "limit_off": round(per_call_us(0), 3),
                "limit_on": round(per_call_us(1_000_000), 3),
            },
            "count_ms_by_unsent_and_limit": {
                unsent: count_ms(url, schema, int(unsent), limits)
                for unsent in args.unsent.split(",")
            },
            "note": "the count runs at most once a second per producer process, only with a limit",
        }
    finally:
        if server is not None:
            server.cleanup()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("per_call_us", "count_ms_by_unsent_and_limit")}))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
