"""What the database libraries cost a producer, per transaction, in client CPU.

The profile of an end-to-end run (``profile_split.py``) puts most of the producers' CPU in
SQLAlchemy and psycopg rather than in ``add_event``. This measures the pieces on their
own, in one thread against one Postgres, as CPU microseconds of this process per
transaction (``time.process_time``: a neighbour's load changes it less than wall time),
each case run ``--rounds`` times with the cases interleaved:

* ``orm_session_empty`` / ``core_connection_empty``: ``Session.begin()`` ... commit, or
  ``engine.begin()`` ... commit, with one trivial ``SELECT 1`` inside (so both send
  BEGIN, a statement and COMMIT);
* ``session_execute_text`` / ``exec_driver_sql``: one INSERT inside an open transaction,
  through ``Session.execute(text(...))`` or ``Connection.exec_driver_sql``;
* ``psycopg_transaction`` / ``psycopg_autocommit``: the same INSERT with psycopg alone, in
  a transaction (BEGIN, INSERT, COMMIT: three round trips) or in autocommit (one).

    python -m benchmarks.dependency_costs --database-url postgresql://... \
        --output benchmarks/results/dependency_costs.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from benchmarks.producer_cost import _code_version, _machine
from pipeline.tools.harness.embedded import EmbeddedPostgres

ROOT = Path(__file__).resolve().parent.parent
TABLE = "bench_dependency_costs"
INSERT_TEXT = text(f"INSERT INTO {TABLE} (n) VALUES (:n)")
INSERT_DRIVER = f"INSERT INTO {TABLE} (n) VALUES (%(n)s)"


@contextmanager
def database(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with EmbeddedPostgres(durable=True) as server:  # started here, deleted afterwards
        yield server.url


def cases(engine: Engine, url: str) -> dict[str, Callable[[int], None]]:
    """Each case runs ``n`` transactions (or statements, for the statement cases)."""
    raw = psycopg.connect(url)
    auto = psycopg.connect(url, autocommit=True)

    def orm_session_empty(n: int) -> None:
        for _ in range(n):
            with Session(engine) as session, session.begin():
                session.connection().exec_driver_sql("SELECT 1")

    def core_connection_empty(n: int) -> None:
        for _ in range(n):
            with engine.begin() as connection:
                connection.exec_driver_sql("SELECT 1")

    def session_execute_text(n: int) -> None:
        with Session(engine) as session, session.begin():
            for i in range(n):
                session.execute(INSERT_TEXT, {"n": i})

    def exec_driver_sql(n: int) -> None:
        with engine.begin() as connection:
            for i in range(n):
                connection.exec_driver_sql(INSERT_DRIVER, {"n": i})

    def psycopg_transaction(n: int) -> None:
        for i in range(n):
            with raw.transaction():
                raw.execute(INSERT_DRIVER, {"n": i})

    def psycopg_autocommit(n: int) -> None:
        for i in range(n):
            auto.execute(INSERT_DRIVER, {"n": i})

    return {
        "orm_session_empty": orm_session_empty,
        "core_connection_empty": core_connection_empty,
        "session_execute_text": session_execute_text,
        "exec_driver_sql": exec_driver_sql,
        "psycopg_transaction": psycopg_transaction,
        "psycopg_autocommit": psycopg_autocommit,
    }


def cpu_us_per_call(case: Callable[[int], None], n: int) -> float:
    started = time.process_time()
    case(n)
    return round((time.process_time() - started) / n * 1e6, 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/dependency_costs.json"))
    args = parser.parse_args(argv)
    with database(args.database_url) as url:
        engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.begin() as connection:
            connection.exec_driver_sql(f"DROP TABLE IF EXISTS {TABLE}")
            connection.exec_driver_sql(f"CREATE TABLE {TABLE} (n integer)")
        runs = cases(engine, url)
        for case in runs.values():
            case(300)  # warm-up: pools, prepared statements, caches
        by_case: dict[str, list[float]] = {name: [] for name in runs}
        for round_number in range(args.rounds):
            names = list(runs)
            names = names[round_number % len(names) :] + names[: round_number % len(names)]
            for name in names:
                by_case[name].append(cpu_us_per_call(runs[name], args.calls))
        with engine.begin() as connection:
            connection.exec_driver_sql(f"DROP TABLE {TABLE}")
        engine.dispose()
    medians = {name: statistics.median(values) for name, values in by_case.items()}
    report: dict[str, Any] = {
        "benchmark": "dependency_costs",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "benchmarks.dependency_costs", *sys.argv[1:]]),
        "machine": _machine(),
        "code": _code_version(),
        "unit": "client CPU microseconds per transaction (per statement for the statement cases)",
        "cpu_us": {
            name: {"by_round": values, "median": medians[name]} for name, values in by_case.items()
        },
        "differences_us": {
            "orm_session_over_core_connection": round(
                medians["orm_session_empty"] - medians["core_connection_empty"], 1
            ),
            "session_execute_text_over_exec_driver_sql": round(
                medians["session_execute_text"] - medians["exec_driver_sql"], 1
            ),
            "begin_and_commit_round_trips_in_psycopg": round(
                medians["psycopg_transaction"] - medians["psycopg_autocommit"], 1
            ),
        },
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    for name, median in medians.items():
        print(f"{name:24} {median:8.1f} µs  {by_case[name]}")
    print(json.dumps(report["differences_us"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
