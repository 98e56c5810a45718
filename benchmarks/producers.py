"""What the outbox costs the transaction that produces events: ``python -m benchmarks.producers``.

The outbox's price is paid inside every business transaction: one more INSERT, the
NOTIFY trigger's relay_state probe and, when it fires, NOTIFY's database-wide commit
lock, which serialises commits. Producers are spawned OS processes, each running several
threads with their own SQLAlchemy ``Session`` calling the real ``add_event`` (one Python
process cannot drive Postgres fast enough to find the database's limit). Strategies:

* ``commit``: committed transactions per second and commit latency at ``--clients``
  producers for each mode, the modes back to back per client count:
  ``business`` (BEGIN; INSERT one order row; COMMIT), ``outbox_notify`` (the same plus
  one event; no relay busy, so every commit NOTIFYs), ``outbox_no_trigger`` (the NOTIFY
  trigger dropped), ``outbox_relay_busy`` (a fresh busy relay_state row, so the trigger
  skips NOTIFY: the design's answer to NOTIFY's commit lock). Before every run the tables
  are emptied, vacuumed and checkpointed, and one probe commit checks that the mode
  really does (or does not) NOTIFY.
* ``prune``: ``--rows`` sent outbox events and processed inbox rows past their retention
  are seeded; the producers (``outbox_relay_busy``) run alone, during one retention pass
  of the janitor's :class:`Pruner`, and alone again; commit latency per window.

Without ``--database-url`` it starts a throwaway durable Postgres; with one it uses the
schema ``pipeline_bench`` (``commit``: TRUNCATED, trigger dropped and re-created).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy
from psycopg import sql
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from benchmarks import harness
from pipeline.config import Settings, configure, libpq_url
from pipeline.db.migrate import functions_sql, notify_channel, upgrade
from pipeline.db.retention import Pruner, RetentionPolicy
from pipeline.outbox import add_event

MODES = ("business", "outbox_notify", "outbox_no_trigger", "outbox_relay_busy")
OUTBOX_MODES = frozenset(MODES[1:])
RELAY_ID = "benchmark-relay"
WARMUP_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0
RETENTION_SECONDS = 24 * 3600  # prune: the seeded rows are two days old
INSERT_ORDER = text("INSERT INTO bench_orders (id, total) VALUES (:id, :t)")


# -- producer processes -------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What one producer process runs; picklable because workers are spawned."""

    database_url: str
    schema: str
    mode: str
    index: int
    threads: int


def _produce(
    spec: WorkerSpec, thread: int, engine: Engine, go: MpEvent, stop: MpEvent, out: dict[str, Any]
) -> None:
    """One producer thread: business transactions back to back until told to stop.

    Records commit end time (monotonic, comparable across processes on Linux), the whole
    transaction's latency and the COMMIT call's latency; the parent picks the window.
    """
    ends, tx_lat, commit_lat = array.array("d"), array.array("d"), array.array("d")
    errors: list[str] = []
    outbox = spec.mode in OUTBOX_MODES
    order_id = ((spec.index * 256 + thread) << 40) + 1  # unique across all producers
    with Session(engine) as session:
        go.wait()
        while not stop.is_set():
            order_id += 1
            total = order_id % 10_000
            started = time.monotonic()
            try:
                session.execute(INSERT_ORDER, {"id": order_id, "t": total})
                if outbox:
                    add_event(
                        session,
                        "order.placed",
                        {"order_id": order_id, "total": total},
                        aggregate_type="order",
                        aggregate_id=str(order_id),
                    )
                before_commit = time.monotonic()
                session.commit()
            except Exception as exc:
                session.rollback()
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                if len(errors) > 100:
                    break
                continue
            done = time.monotonic()
            ends.append(done)
            tx_lat.append(done - started)
            commit_lat.append(done - before_commit)
    out.update(ends=ends, tx_lat=tx_lat, commit_lat=commit_lat, errors=errors)


def worker_main(spec: WorkerSpec, go: MpEvent, stop: MpEvent, ready: Any, results: Any) -> None:
    """Entry point of one producer process: connect everything, report ready, produce."""
    try:
        configure(Settings(database_url=SecretStr(spec.database_url), schema_name=spec.schema))
        engine = create_engine(sqlalchemy_url(spec.database_url), pool_size=spec.threads)
        with contextlib.ExitStack() as stack:  # every pooled connection open before the clock
            for _ in range(spec.threads):
                stack.enter_context(engine.connect()).execute(text("SELECT 1"))
        outs: list[dict[str, Any]] = [{} for _ in range(spec.threads)]
        threads = [
            threading.Thread(target=_produce, args=(spec, n, engine, go, stop, outs[n]))
            for n in range(spec.threads)
        ]
        for thread in threads:
            thread.start()
        ready.put(None)
        for thread in threads:
            thread.join()
        engine.dispose()
    except BaseException as exc:
        ready.put(f"producer {spec.index}: {type(exc).__name__}: {exc}")
        raise
    merged: dict[str, Any] = {"index": spec.index, "errors": []}
    for key in ("ends", "tx_lat", "commit_lat"):
        merged[key] = b"".join(out.get(key, array.array("d")).tobytes() for out in outs)
    for out in outs:
        merged["errors"].extend(out.get("errors", []))
    results.put(merged)


def sqlalchemy_url(url: str) -> str:
    return "postgresql+psycopg://" + libpq_url(url).split("://", 1)[1]


def split(clients: int, max_processes: int) -> list[int]:
    """Threads per process: clients spread evenly over at most ``max_processes``."""
    processes = max(1, min(clients, max_processes))
    base, extra = divmod(clients, processes)
    return [base + (1 if n < extra else 0) for n in range(processes)]


@dataclass
class Commits:
    """What the producers recorded: commit end times and latencies, errors."""

    ends: array.array[float]
    tx_lat: array.array[float]
    commit_lat: array.array[float]
    errors: list[str]

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Commits that ended in [start, end): rate and latency."""
        inside = [i for i, t in enumerate(self.ends) if start <= t < end]
        tx = [self.tx_lat[i] for i in inside]
        commit = [self.commit_lat[i] for i in inside]
        return {
            "seconds": round(end - start, 2),
            "commits": len(inside),
            "tx_per_s": round(len(inside) / max(end - start, 1e-9), 1),
            "latency_ms": {
                "tx_p50": harness.ms(harness.percentile(tx, 0.50)),
                "tx_p99": harness.ms(harness.percentile(tx, 0.99)),
                "commit_p50": harness.ms(harness.percentile(commit, 0.50)),
                "commit_p99": harness.ms(harness.percentile(commit, 0.99)),
            },
        }


class Producers:
    """Producer processes for one mode, connected and waiting; :meth:`go` starts them."""

    def __init__(self, url: str, schema: str, mode: str, clients: int, max_processes: int) -> None:
        self.split = split(clients, max_processes)
        specs = [WorkerSpec(url, schema, mode, n, size) for n, size in enumerate(self.split)]
        self._group = harness.Spawned(worker_main, specs)

    @property
    def pids(self) -> list[int]:
        return self._group.pids

    def go(self) -> None:
        self._group.go.set()

    def finish(self) -> Commits:
        """Stop producing (``finish`` is their stop signal) and collect what they recorded."""
        self._group.finish.set()
        commits = Commits(array.array("d"), array.array("d"), array.array("d"), [])
        for part in self._group.results(timeout=120):
            commits.ends.frombytes(part["ends"])
            commits.tx_lat.frombytes(part["tx_lat"])
            commits.commit_lat.frombytes(part["commit_lat"])
            commits.errors.extend(part["errors"])
        self.close()
        return commits

    def close(self) -> None:
        self._group.close()


# -- the database's state per mode --------------------------------------------------------


class Heartbeat:
    """A fake busy relay: keeps its relay_state row fresh so the trigger skips NOTIFY."""

    def __init__(self, url: str, schema: str) -> None:
        self._conn = psycopg.connect(url, autocommit=True)
        self._table = sql.Identifier(schema, "relay_state")
        self._stop = threading.Event()
        self.error: str | None = None
        self._conn.execute(
            sql.SQL("INSERT INTO {} (relay_id, busy, host, pid) VALUES (%s, true, %s, %s)").format(
                self._table
            ),
            (RELAY_ID, socket.gethostname(), os.getpid()),
        )
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        update = sql.SQL(
            "UPDATE {} SET heartbeat_at = clock_timestamp() WHERE relay_id = %s"
        ).format(self._table)
        try:
            while not self._stop.wait(HEARTBEAT_SECONDS):
                self._conn.execute(update, (RELAY_ID,))
        except psycopg.Error as exc:  # a stale row would let NOTIFY back in unnoticed
            self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()


class Bench:
    """Owns the admin connection and puts the database in each mode's state."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = libpq_url(url)
        self.schema = schema
        self.admin = psycopg.connect(self.url, autocommit=True)
        self.outbox = sql.Identifier(schema, "outbox")

    def migrate(self) -> None:
        engine = create_engine(sqlalchemy_url(self.url))
        with engine.begin() as connection:
            upgrade(connection, self.schema)
            connection.exec_driver_sql(
                "CREATE TABLE IF NOT EXISTS public.bench_orders ("
                " id bigint PRIMARY KEY, total numeric(12, 2) NOT NULL,"
                " created_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        engine.dispose()

    def set_trigger(self, present: bool) -> None:
        if not present:
            self.admin.execute(
                sql.SQL("DROP TRIGGER IF EXISTS outbox_notify ON {}").format(self.outbox)
            )
            return
        exists = self.admin.execute(
            "SELECT 1 FROM pg_trigger WHERE tgname = 'outbox_notify' AND tgrelid = %s::regclass",
            (f"{self.schema}.outbox",),
        ).fetchone()
        if exists is None:  # re-create it exactly as the migration does
            with self.admin.transaction():
                self.admin.execute(
                    sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(self.schema))
                )
                self.admin.execute(functions_sql(self.schema).encode())

    def reset(self) -> None:
        """Empty tables, reclaim space and checkpoint, so every run starts alike."""
        self.admin.execute(
            sql.SQL("TRUNCATE public.bench_orders, {}, {} RESTART IDENTITY").format(
                self.outbox, sql.Identifier(self.schema, "relay_state")
            )
        )
        self.admin.execute(sql.SQL("VACUUM ANALYZE public.bench_orders, {}").format(self.outbox))
        with contextlib.suppress(psycopg.Error):  # needs superuser or pg_checkpoint
            self.admin.execute("CHECKPOINT")

    def notifies_on_commit(self) -> bool:
        """Commit one event through the producer API and see whether a NOTIFY arrives."""
        with psycopg.connect(self.url, autocommit=True) as listener:
            listener.execute(
                sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(self.schema)))
            )
            engine = create_engine(sqlalchemy_url(self.url), poolclass=sqlalchemy.NullPool)
            with Session(engine) as session:
                add_event(session, "benchmark.probe", {})
                session.commit()
            engine.dispose()
            return bool(list(listener.notifies(timeout=0.5, stop_after=1)))

    def close(self) -> None:
        """Leave the schema as the migration made it (trigger back, no fake relay)."""
        try:
            self.set_trigger(present=True)
            self.admin.execute(
                sql.SQL("DELETE FROM {} WHERE relay_id = %s").format(
                    sql.Identifier(self.schema, "relay_state")
                ),
                (RELAY_ID,),
            )
        except psycopg.Error as exc:  # do not hide the error that brought us here
            print(f"warning: could not restore {self.schema}: {exc}", file=sys.stderr)
        finally:
            self.admin.close()


@contextlib.contextmanager
def mode_state(bench: Bench, mode: str) -> Iterator[bool]:
    """Put the database in ``mode``'s state; yields whether a commit NOTIFYs."""
    bench.set_trigger(present=mode != "outbox_no_trigger")
    bench.reset()
    heartbeat = Heartbeat(bench.url, bench.schema) if mode == "outbox_relay_busy" else None
    try:
        notifies = bench.notifies_on_commit()
        expected = mode in ("business", "outbox_notify")
        if notifies != expected:
            raise RuntimeError(
                f"mode {mode}: a commit {'did' if notifies else 'did not'} NOTIFY, expected "
                f"the opposite (is a real relay marked busy in {bench.schema}.relay_state?)"
            )
        bench.admin.execute(sql.SQL("TRUNCATE {}").format(bench.outbox))  # the probe event
        yield notifies
    finally:
        if heartbeat is not None:
            heartbeat.close()
    if heartbeat is not None and heartbeat.error is not None:
        raise RuntimeError(f"mode {mode}: the fake relay's heartbeat failed: {heartbeat.error}")


@dataclass
class Window:
    """A measurement window (monotonic seconds) and the CPU samples at its ends."""

    start: float
    end: float
    before: harness.CpuSample
    after: harness.CpuSample


def run_one(
    bench: Bench,
    mode: str,
    clients: int,
    max_processes: int,
    duration: float,
    server_pid: int | None,
) -> tuple[dict[str, Any], Window]:
    """One (mode, clients) run: spawn producers, warm up, count commits in the window."""
    with mode_state(bench, mode) as notifies:
        producers = Producers(bench.url, bench.schema, mode, clients, max_processes)
        try:
            producers.go()
            start = time.monotonic() + WARMUP_SECONDS
            end = start + duration
            time.sleep(max(0.0, start - time.monotonic()))
            before = harness.sample()
            time.sleep(max(0.0, end - time.monotonic()))
            after = harness.sample()
            commits = producers.finish()
        finally:
            producers.close()
    measured = commits.window(start, end)
    run = {
        "mode": mode,
        "clients": clients,
        "processes": len(producers.split),
        "threads_per_process": producers.split,
        "window_s": duration,
        "commits": measured["commits"],
        "tx_per_s": measured["tx_per_s"],
        "latency_ms": measured["latency_ms"],
        "event_commit_notifies": notifies,
        "errors": len(commits.errors),
        "first_errors": commits.errors[:3],
        "cpu": harness.cpu_report(before, after, measured["commits"], producers.pids, server_pid),
    }
    return run, Window(start, end, before, after)


# -- strategies ---------------------------------------------------------------------------


def ratios_to_business(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    rate = {(r["mode"], r["clients"]): r["tx_per_s"] for r in runs}
    ratios: dict[str, dict[str, float | None]] = {}
    for clients in sorted({r["clients"] for r in runs}):
        base = rate.get(("business", clients))
        ratios[str(clients)] = {
            f"{mode}/business": (
                round(rate[(mode, clients)] / base, 3) if base and (mode, clients) in rate else None
            )
            for mode in MODES[1:]
        }
    return ratios


def commit(args: argparse.Namespace, servers: harness.Servers, schema: str) -> dict[str, Any]:
    """The modes back to back per client count, so each ratio compares neighbouring runs."""
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    bench = Bench(servers.database_url, schema)
    runs: list[dict[str, Any]] = []
    try:
        bench.migrate()
        for clients in [int(c) for c in args.clients.split(",") if c]:
            for mode in modes:
                run, _ = run_one(
                    bench, mode, clients, args.processes, args.duration, servers.postgres_pid
                )
                runs.append(run)
                print(
                    f"  {mode:<18} clients={clients:<3} {run['tx_per_s']:>8.0f} tx/s"
                    f"  commit p50 {run['latency_ms']['commit_p50']} ms"
                    f"  other CPU {run['cpu'].get('other_pct')} %",
                    flush=True,
                )
    finally:
        bench.close()
    return {"runs": runs, "ratios": ratios_to_business(runs)}


def prune(args: argparse.Namespace, servers: harness.Servers, schema: str) -> dict[str, Any]:
    """Producers' commit latency before, during and after one retention pass."""
    if schema != "pipeline":
        raise SystemExit("prune seeds the 'pipeline' schema: use the embedded server")
    url = servers.database_url
    bench = Bench(url, schema)
    bench.migrate()
    bench.close()
    print(f"seeding {args.rows} outbox and inbox rows...", flush=True)
    seeded = harness.seed_sent_rows(url, args.rows, "2 days", "1 millisecond")
    policy = RetentionPolicy(
        outbox=RETENTION_SECONDS,
        inbox=RETENTION_SECONDS,
        attempts=RETENTION_SECONDS,
        audit_log=RETENTION_SECONDS,
        batch_size=args.batch_size,
    )
    clients = int(args.clients.split(",")[-1])
    heartbeat = Heartbeat(url, schema)
    producers = Producers(url, schema, "outbox_relay_busy", clients, args.processes)
    try:
        producers.go()
        time.sleep(WARMUP_SECONDS)
        windows = {"baseline": (time.monotonic(), time.monotonic() + args.duration)}
        time.sleep(args.duration)
        with psycopg.connect(url, autocommit=True) as conn:
            started = time.monotonic()
            result = Pruner(schema, policy, pause=args.pause).run(conn).as_json()
            windows["during_prune"] = (started, time.monotonic())
        windows["after"] = (time.monotonic(), time.monotonic() + args.duration)
        time.sleep(args.duration)
        commits = producers.finish()
    finally:
        producers.close()
        heartbeat.close()
    phases = {name: commits.window(*span) for name, span in windows.items()}
    seconds = windows["during_prune"][1] - windows["during_prune"][0]
    during, base = (phases[p]["latency_ms"]["commit_p99"] for p in ("during_prune", "baseline"))
    return {
        "parameters": {
            "rows": args.rows,
            "clients": clients,
            "batch_size": args.batch_size,
            "pause_s": args.pause,
            "producer_mode": "outbox_relay_busy (no NOTIFY), one business row + one event",
        },
        "seed_seconds": round(seeded, 1),
        "prune": {
            "seconds": round(seconds, 2),
            "deleted": result["deleted"],
            "rows_per_s": round(result["deleted"] / max(seconds, 1e-9)),
            "tables": result["tables"],
        },
        "producers": phases,
        "producer_errors": len(commits.errors),
        "p99_commit_ratio_during_to_baseline": round(during / base, 2) if during and base else None,
    }


STRATEGIES = {"commit": commit, "prune": prune}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", default="commit", help="strategies: commit, prune")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument("--clients", default="1,8,32", help="producer counts (prune: the last one)")
    parser.add_argument("--modes", default=",".join(MODES), help="commit: the modes")
    parser.add_argument("--processes", type=int, default=4, help="max producer processes")
    parser.add_argument("--rows", type=int, default=1_000_000, help="prune: rows to delete")
    parser.add_argument("--batch-size", type=int, default=5000, help="prune: rows per batch")
    parser.add_argument("--pause", type=float, default=0.0, help="prune: seconds between batches")
    parser.add_argument("--database-url", default=os.environ.get("PIPELINE_DATABASE_URL"))
    parser.add_argument("--output", type=Path, default=harness.RESULTS / "producer_cost.json")
    args = parser.parse_args(argv)
    strategies = [s for s in args.only.split(",") if s]
    if unknown := sorted(set(strategies) - set(STRATEGIES)):
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    report = harness.header("producers", argv)
    with harness.servers(args.database_url, with_redis=False) as servers:
        schema = "pipeline_bench" if args.database_url else "pipeline"
        configure(Settings(database_url=SecretStr(servers.database_url), schema_name=schema))
        report["servers"] = servers.describe()
        for name in strategies:
            report[name] = STRATEGIES[name](args, servers, schema)
            harness.write_report(args.output, report)
    return harness.done(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
