"""Producer cost: what the transactional outbox adds to a business transaction.

The outbox's price is paid inside every business transaction: one more INSERT, the
NOTIFY trigger's relay_state probe and, when it fires, NOTIFY's database-wide commit
lock, which serialises commits (and so their WAL flushes). This script measures
committed transactions per second and commit latency for four modes at several
producer concurrencies, against a real durable Postgres, through the real producer
API (a SQLAlchemy ``Session`` plus :func:`pipeline.add_event`):

* ``business``: BEGIN; INSERT one small business row; COMMIT.
* ``outbox_notify``: the same plus one event; trigger active, no relay busy, so every
  commit NOTIFYs.
* ``outbox_no_trigger``: as ``outbox_notify`` with the trigger dropped.
* ``outbox_relay_busy``: as ``outbox_notify`` with a fresh busy row in relay_state
  (heartbeat refreshed every second), so the trigger skips NOTIFY: the design's answer
  to NOTIFY's commit lock.

Producers are several spawned OS processes, each running several threads with their
own ``Session``, because one Python process cannot drive Postgres fast enough to find
the database's limit. CPU used by the producers, the server and everything else is
recorded per run so that the reader can tell a commit-bound run from a CPU-bound one.

Usage: ``python benchmarks/producer_cost.py [--duration 8] [--clients 1,8,32]
[--modes ...] [--database-url URL] [--output benchmarks/results/producer_cost.json]``.
Without a database URL (``--database-url`` or ``PIPELINE_DATABASE_URL``) it starts a
throwaway durable Postgres (fsync on) and removes it afterwards.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import datetime as dt
import hashlib
import json
import multiprocessing as mp
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
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

from pipeline.config import Settings, configure, libpq_url
from pipeline.db.migrate import functions_sql, notify_channel, upgrade
from pipeline.outbox import add_event
from pipeline.tools.harness.embedded import EmbeddedPostgres

MODES = ("business", "outbox_notify", "outbox_no_trigger", "outbox_relay_busy")
OUTBOX_MODES = frozenset(MODES[1:])
RELAY_ID = "benchmark-relay"
WARMUP_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "producer_cost.json"
INSERT_ORDER = text("INSERT INTO bench_orders (id, total) VALUES (:id, :t)")
SHOWN_SETTINGS = (
    "server_version",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_level",
    "wal_sync_method",
    "commit_delay",
    "shared_buffers",
    "max_wal_size",
    "checkpoint_timeout",
    "max_connections",
)


# -- producers (run in spawned worker processes) ------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What one producer process runs; picklable because workers are spawned."""

    database_url: str
    schema: str
    mode: str
    index: int
    threads: int


def _produce(
    spec: WorkerSpec,
    thread: int,
    engine: Engine,
    go: MpEvent,
    stop: MpEvent,
    out: dict[str, Any],
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
        # The producer reads the schema name from the process-wide settings.
        configure(Settings(database_url=SecretStr(spec.database_url), schema_name=spec.schema))
        engine = create_engine(
            _sqlalchemy_url(spec.database_url), pool_size=spec.threads, max_overflow=0
        )
        # Open every pooled connection before the clock starts.
        with contextlib.ExitStack() as stack:
            for _ in range(spec.threads):
                stack.enter_context(engine.connect()).execute(text("SELECT 1"))
        outs: list[dict[str, Any]] = [{} for _ in range(spec.threads)]
        threads = [
            threading.Thread(target=_produce, args=(spec, n, engine, go, stop, outs[n]))
            for n in range(spec.threads)
        ]
        for thread in threads:
            thread.start()
        ready.put((spec.index, None))
        for thread in threads:
            thread.join()
        engine.dispose()
    except BaseException as exc:
        ready.put((spec.index, f"{type(exc).__name__}: {exc}"))
        raise
    merged: dict[str, Any] = {"index": spec.index, "errors": []}
    for key in ("ends", "tx_lat", "commit_lat"):
        merged[key] = b"".join(out.get(key, array.array("d")).tobytes() for out in outs)
    for out in outs:
        merged["errors"].extend(out.get("errors", []))
    results.put(merged)


# -- orchestration (parent process) -------------------------------------------------------


def _sqlalchemy_url(url: str) -> str:
    return "postgresql+psycopg://" + libpq_url(url).split("://", 1)[1]


def _split(clients: int, max_processes: int) -> list[int]:
    """Threads per process: clients spread evenly over at most ``max_processes``."""
    processes = max(1, min(clients, max_processes))
    base, extra = divmod(clients, processes)
    return [base + (1 if n < extra else 0) for n in range(processes)]


def _cpu_ticks_machine() -> tuple[int, int, int]:
    """(busy, iowait, total) jiffies over all CPUs since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle, iowait = fields[3], fields[4]
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle - iowait, iowait, total


def _processes() -> dict[int, tuple[str, int, int]]:
    """(name, ppid, utime + stime of all threads in clock ticks) of every live process.

    Processes that start or end inside the window are missed: their CPU shows up only in
    the machine-wide ``other_pct``, not in ``other_top``.
    """
    found: dict[int, tuple[str, int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                found[int(entry.name)] = (name, int(fields[1]), int(fields[11]) + int(fields[12]))
    return found


@dataclass
class CpuSample:
    machine: tuple[int, int, int]
    processes: dict[int, tuple[str, int, int]]


def _sample() -> CpuSample:
    return CpuSample(_cpu_ticks_machine(), _processes())


def _cpu_report(
    before: CpuSample,
    after: CpuSample,
    commits: int,
    producer_pids: Sequence[int],
    server_pid: int | None,
) -> dict[str, Any]:
    """Where the machine's CPU went during the window.

    Percentages are of the whole machine's capacity; CPU milliseconds per commit is what
    a CPU-bound machine actually pays per transaction. ``other`` is everything that is
    neither the producers nor Postgres (this script's parent included), by process name,
    so a noisy neighbour shows up in the data rather than only as odd numbers.
    """
    total = after.machine[2] - before.machine[2]
    if total <= 0:
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    used: dict[int, int] = {
        pid: ticks - before.processes[pid][2]
        for pid, (_, _, ticks) in after.processes.items()
        if pid in before.processes
    }
    producers = sum(used.get(pid, 0) for pid in producer_pids)
    server_pids = {
        pid
        for pid, (_, ppid, _) in after.processes.items()
        if server_pid is not None and server_pid in (pid, ppid)
    }
    server = sum(used.get(pid, 0) for pid in server_pids)
    others: dict[str, int] = {}
    for pid, ticks in used.items():
        if ticks and pid not in server_pids and pid not in producer_pids:
            name = after.processes[pid][0]
            others[name] = others.get(name, 0) + ticks

    def pct(ticks: int) -> float:
        return round(100 * ticks / total, 1)

    def per_tx(ticks: int) -> float | None:
        return round(1000 * ticks / hz / commits, 3) if commits else None

    busy = after.machine[0] - before.machine[0]
    known = server_pid is not None
    return {
        "machine_busy_pct": pct(busy),
        "iowait_pct": pct(after.machine[1] - before.machine[1]),
        "producers_pct": pct(producers),
        "postgres_pct": pct(server) if known else None,
        "other_pct": pct(busy - producers - server) if known else None,
        "other_top": {
            name: pct(ticks)
            for name, ticks in sorted(others.items(), key=lambda item: -item[1])[:4]
        },
        "producers_cpu_ms_per_tx": per_tx(producers),
        "postgres_cpu_ms_per_tx": per_tx(server) if known else None,
    }


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


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
        engine = create_engine(_sqlalchemy_url(self.url))
        with engine.begin() as connection:
            upgrade(connection, self.schema)
            connection.exec_driver_sql(
                "CREATE TABLE IF NOT EXISTS public.bench_orders ("
                " id bigint PRIMARY KEY, total numeric(12, 2) NOT NULL,"
                " created_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        engine.dispose()

    def server_settings(self) -> dict[str, str]:
        shown = {}
        for name in SHOWN_SETTINGS:
            row = self.admin.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            shown[name] = str(row[0]) if row else ""
        return shown

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
        # A checkpoint now rather than mid-run; needs superuser/pg_checkpoint, so optional.
        with contextlib.suppress(psycopg.Error):
            self.admin.execute("CHECKPOINT")

    def notifies_on_commit(self) -> bool:
        """Commit one event through the producer API and see whether a NOTIFY arrives."""
        with psycopg.connect(self.url, autocommit=True) as listener:
            listener.execute(
                sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(self.schema)))
            )
            engine = create_engine(_sqlalchemy_url(self.url), poolclass=sqlalchemy.NullPool)
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


def run_one(
    bench: Bench,
    mode: str,
    clients: int,
    max_processes: int,
    duration: float,
    server_pid: int | None,
) -> dict[str, Any]:
    """One (mode, clients) run: spawn producers, warm up, count commits in the window."""
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    ready, results = ctx.Queue(), ctx.Queue()
    split = _split(clients, max_processes)
    with mode_state(bench, mode) as notifies:
        processes = [
            ctx.Process(
                target=worker_main,
                args=(
                    WorkerSpec(bench.url, bench.schema, mode, n, size),
                    go,
                    stop,
                    ready,
                    results,
                ),
                daemon=True,
            )
            for n, size in enumerate(split)
        ]
        for process in processes:
            process.start()
        try:
            for _ in processes:
                index, error = ready.get(timeout=120)
                if error is not None:
                    raise RuntimeError(f"producer process {index} failed to start: {error}")
            client_pids = [p.pid for p in processes if p.pid is not None]
            go.set()
            start = time.monotonic() + WARMUP_SECONDS
            end = start + duration
            time.sleep(max(0.0, start - time.monotonic()))
            before = _sample()
            time.sleep(max(0.0, end - time.monotonic()))
            after = _sample()
            stop.set()
            collected = [results.get(timeout=120) for _ in processes]
        finally:
            stop.set()
            go.set()
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
    ends, tx_lat, commit_lat = array.array("d"), array.array("d"), array.array("d")
    errors: list[str] = []
    for part in collected:
        ends.frombytes(part["ends"])
        tx_lat.frombytes(part["tx_lat"])
        commit_lat.frombytes(part["commit_lat"])
        errors.extend(part["errors"])
    inside = [i for i, t in enumerate(ends) if start <= t < end]
    tx_in = [tx_lat[i] for i in inside]
    commit_in = [commit_lat[i] for i in inside]
    return {
        "mode": mode,
        "clients": clients,
        "processes": len(split),
        "threads_per_process": split,
        "window_s": duration,
        "commits": len(inside),
        "tx_per_s": round(len(inside) / duration, 1),
        "latency_ms": {
            "tx_p50": _ms(_percentile(tx_in, 0.50)),
            "tx_p99": _ms(_percentile(tx_in, 0.99)),
            "commit_p50": _ms(_percentile(commit_in, 0.50)),
            "commit_p99": _ms(_percentile(commit_in, 0.99)),
        },
        "event_commit_notifies": notifies,
        "errors": len(errors),
        "first_errors": errors[:3],
        "cpu": _cpu_report(before, after, len(inside), client_pids, server_pid),
    }


def _fsync_probe(directory: Path, seconds: float = 1.0) -> dict[str, float]:
    """8 KiB write + fdatasync loop on the data directory's filesystem.

    Serialised commits (NOTIFY's lock) cannot beat this rate, so it frames the results.
    """
    block = os.urandom(8192)
    count = 0
    fd, name = tempfile.mkstemp(dir=directory, prefix="fsync-probe-")
    try:
        deadline = time.monotonic() + seconds
        started = time.monotonic()
        while time.monotonic() < deadline:
            os.pwrite(fd, block, 0)
            os.fdatasync(fd)
            count += 1
        elapsed = time.monotonic() - started
    finally:
        os.close(fd)
        os.unlink(name)
    return {
        "fdatasync_per_s": round(count / elapsed, 1),
        "ms": round(1000 * elapsed / count, 3),
    }


def _machine() -> dict[str, Any]:
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg_at_start": os.getloadavg(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "psycopg": psycopg.__version__,
        "sqlalchemy": sqlalchemy.__version__,
    }


def _code_version() -> dict[str, Any]:
    """The code under test: commit, uncommitted changes, and a hash of pipeline/ itself.

    The tree hash is what identifies the measured code when the working tree is dirty,
    and comparing it before and after a run catches edits made while it ran.
    """
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((root / "pipeline").rglob("*")):
        if path.suffix in (".py", ".sql") and path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.rstrip()

    status = git("status", "--porcelain", "--", "pipeline")
    return {
        "commit": git("rev-parse", "HEAD"),
        "pipeline_changes": status.splitlines() if status else [],
        "pipeline_sha256": digest.hexdigest(),
    }


def _ratios(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    rate = {(r["mode"], r["clients"]): r["tx_per_s"] for r in runs}
    ratios: dict[str, dict[str, float | None]] = {}
    for clients in sorted({r["clients"] for r in runs}):
        base = rate.get(("business", clients))
        ratios[str(clients)] = {
            f"{mode}/business": (
                round(rate[(mode, clients)] / base, 3) if base and (mode, clients) in rate else None
            )
            for mode in ("outbox_relay_busy", "outbox_notify", "outbox_no_trigger")
        }
    return ratios


def _table(runs: list[dict[str, Any]], ratios: dict[str, dict[str, float | None]]) -> str:
    lines = [
        f"{'clients':>7}  {'mode':<18} {'tx/s':>8} {'commit p50':>10} {'p99 ms':>8} "
        f"{'producers':>9} {'postgres':>8} {'other':>6} {'x busi':>7}"
    ]
    for run in runs:
        lat, cpu = run["latency_ms"], run["cpu"]
        ratio = ratios[str(run["clients"])].get(f"{run['mode']}/business")
        ratio_text = "1.000" if run["mode"] == "business" else f"{ratio or 0:.3f}"

        def pct(key: str, cpu: dict[str, Any] = cpu) -> str:
            return "-" if cpu.get(key) is None else f"{cpu[key]:.0f}%"

        lines.append(
            f"{run['clients']:>7}  {run['mode']:<18} {run['tx_per_s']:>8.0f} "
            f"{lat['commit_p50'] or 0:>10.2f} {lat['commit_p99'] or 0:>8.2f} "
            f"{pct('producers_pct'):>9} {pct('postgres_pct'):>8} {pct('other_pct'):>6} "
            f"{ratio_text:>7}" + (f"  ERRORS={run['errors']}" if run["errors"] else "")
        )
    lines.append("CPU columns: share of the whole machine's capacity during the window.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated producer counts")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--database-url", default=os.environ.get("PIPELINE_DATABASE_URL"))
    parser.add_argument(
        "--schema",
        help="pipeline schema to benchmark (TRUNCATED); default 'pipeline' on the embedded "
        "server, 'pipeline_bench' on a --database-url so a real outbox is never touched",
    )
    parser.add_argument(
        "--processes", type=int, default=4, help="max producer processes (threads share them)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    schema = args.schema or ("pipeline_bench" if args.database_url else "pipeline")

    started_at = dt.datetime.now(dt.UTC)
    machine = _machine()  # before we load the machine ourselves
    code = _code_version()
    server: EmbeddedPostgres | None = None
    url: str | None = args.database_url
    disk: dict[str, Any] | None = None
    if url is None:
        server = EmbeddedPostgres(durable=True)
        try:
            server.start()
        except BaseException:
            server.cleanup()  # a failed start leaves its data directory behind
            raise
        url = server.url
    try:
        if server is not None:
            disk = {"data_dir": str(server.data_dir), **_fsync_probe(server.data_dir.parent)}
        configure(Settings(database_url=SecretStr(url), schema_name=schema))
        bench = Bench(url, schema)
        try:
            bench.migrate()
            settings = bench.server_settings()
            print(
                f"Postgres {settings['server_version']}: fsync={settings['fsync']} "
                f"synchronous_commit={settings['synchronous_commit']} "
                f"full_page_writes={settings['full_page_writes']} wal_level={settings['wal_level']}"
                + (f"; fdatasync {disk['fdatasync_per_s']:.0f}/s" if disk else ""),
                flush=True,
            )
            runs: list[dict[str, Any]] = []
            # Modes interleaved per client count, so each ratio compares neighbouring runs.
            for clients in clients_list:
                for mode in modes:
                    run = run_one(
                        bench,
                        mode,
                        clients,
                        args.processes,
                        args.duration,
                        server.pid if server is not None else None,
                    )
                    runs.append(run)
                    print(
                        f"  {mode:<18} clients={clients:<3} {run['tx_per_s']:>8.0f} tx/s"
                        f"  commit p50 {run['latency_ms']['commit_p50']} ms",
                        flush=True,
                    )
        finally:
            bench.close()
    finally:
        if server is not None:
            server.cleanup()

    ratios = _ratios(runs)
    code["changed_during_run"] = _code_version()["pipeline_sha256"] != code["pipeline_sha256"]
    if code["changed_during_run"]:
        print("warning: pipeline/ changed while the benchmark ran", file=sys.stderr)
    report = {
        "benchmark": "producer_cost",
        "date": started_at.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv] if argv is None else [*argv]),
        "cwd": str(Path.cwd()),
        "parameters": {
            "duration_s": args.duration,
            "warmup_s": WARMUP_SECONDS,
            "clients": clients_list,
            "modes": modes,
            "max_processes": args.processes,
            "schema": schema,
            "database": "embedded (EmbeddedPostgres durable=True)" if server else "external",
        },
        "server": settings,
        "disk": disk,
        "machine": machine,
        "code": code,
        "runs": runs,
        "ratios": ratios,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(_table(runs, ratios))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
