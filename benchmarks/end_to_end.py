"""End to end: producer commit → handler done, through relay, Redis and Dramatiq workers.

Everything runs on this machine: a durable Postgres (fsync on) and a Redis started by
the script (unless URLs are given), one ``pipeline relay`` process and one
``pipeline worker`` process (2 worker processes x 8 threads by default) whose consumer
``e2e`` does one trivial INSERT per event (``benchmarks/e2e_app.py``). Producers use the
real API (``add_event`` in a SQLAlchemy session), one event per transaction unless
``--events-per-transaction`` says more (then ``add_events``).

* ``latency``: open-loop producers offer a fixed rate (500 and 1,000 events/s by default)
  for ``--duration`` seconds; latency = handler done (``time.time()`` in the handler) -
  the producer's commit returning (``time.time()`` after ``commit()``); one machine, one
  clock. A rate counts as sustained when every event is processed within 2 s of the last
  commit.
* ``throughput``: closed-loop producers commit as fast as they can for ``--duration``
  seconds; throughput = events processed per second in the window.

Usage: ``python benchmarks/end_to_end.py [--rates 500,1000] [--duration 10]
[--producers 8] [--output benchmarks/results/end_to_end.json]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from benchmarks import producer_cost as pc
from benchmarks.e2e_app import API_VARIABLE
from benchmarks.producer_cost import _machine, _ms, _percentile
from pipeline.config import Settings, configure
from pipeline.db.migrate import upgrade
from pipeline.outbox import NewEvent, add_event, add_events
from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
EVENT_TYPE = "bench.e2e"
PRODUCER_APPLICATION = "pipeline-bench-producer"
WARM_UP_SECONDS = 6.0


@contextmanager
def servers(database_url: str | None, redis_url: str | None) -> Iterator[tuple[str, str]]:
    started: list[Any] = []
    try:
        if database_url is None:
            postgres = EmbeddedPostgres(durable=True)
            postgres.start()
            started.append(postgres)
            database_url = postgres.url
        if redis_url is None:
            redis_server = EmbeddedRedis()
            redis_server.start()
            started.append(redis_server)
            redis_url = redis_server.url
        yield database_url, redis_url
    finally:
        for server in reversed(started):
            server.cleanup()


def durability(url: str) -> dict[str, str]:
    names = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_level")
    with psycopg.connect(url) as conn:
        rows = {name: conn.execute(f"SHOW {name}").fetchone() for name in names}
    return {name: str(row[0]) if row else "" for name, row in rows.items()}


def _log(directory: Path, name: str) -> Any:
    directory.mkdir(parents=True, exist_ok=True)
    return (directory / f"{name}.log").open("wb")


class OtlpSink(ThreadingHTTPServer):
    """A local OTLP/HTTP endpoint that accepts and discards spans (a collector stand-in)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def observability_env(mode: str, sink: OtlpSink, sample_ratio: float = 0.1) -> dict[str, str]:
    """The environment of one observability mode.

    ``on``: every span exported over OTLP/HTTP (producers too) and both /metrics endpoints
    served; ``sampled``: the same with head sampling (``parentbased_traceidratio`` at
    ``sample_ratio``: every event still carries its trace context, by default one trace
    in ten is recorded); ``off``:
    neither; ``tracing`` or ``metrics``: only that half (to split the cost); ``default``:
    as shipped, no ``OTEL_*`` variable (spans get ids, nothing is exported) and /metrics.
    """
    modes = ("on", "sampled", "off", "tracing", "metrics", "default")
    if mode not in modes:
        raise SystemExit(f"unknown observability mode {mode!r}: use {', '.join(modes)}")
    env: dict[str, str] = {}
    if mode in ("on", "sampled", "tracing"):
        env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint)
    elif mode != "default":
        env["OTEL_SDK_DISABLED"] = "true"
    if mode == "sampled":
        env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        env["OTEL_TRACES_SAMPLER_ARG"] = str(sample_ratio)
    metrics_on = mode in ("on", "sampled", "metrics", "default")
    env["PIPELINE_METRICS_PORT"] = str(free_port()) if metrics_on else "0"
    env["PIPELINE_WORKER_METRICS_PORT"] = str(free_port()) if metrics_on else "0"
    return env


def base_environment() -> dict[str, str]:
    """This process's environment without ``OTEL_*`` variables, which the modes set.

    ``OTEL_BSP_*`` (batch span processor tuning) is kept, to measure its effect.
    """
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("OTEL_") or name.startswith("OTEL_BSP_")
    }


class Pipeline:
    """A relay and a worker process for the benchmark consumer."""

    def __init__(
        self,
        settings: Settings,
        processes: int,
        threads: int,
        logs: Path,
        extra_env: dict[str, str],
    ) -> None:
        env = base_environment()
        env.update(
            PIPELINE_DATABASE_URL=settings.require_database_url(),
            PIPELINE_REDIS_URL=settings.require_redis_url(),
            PIPELINE_APP_MODULES="benchmarks.e2e_app",
            PYTHONPATH=str(ROOT),
            PIPELINE_LOG_LEVEL="WARNING",
            PIPELINE_CANARY_INTERVAL="0",
        )
        env.update(extra_env)
        commands = {
            "relay": ["relay"],
            "worker": ["worker", "--processes", str(processes), "--threads", str(threads)],
        }
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "pipeline.tools.cli", *command],
                env=env,
                stdout=_log(logs, name),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for name, command in commands.items()
        ]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


@contextmanager
def transaction(engine: Any) -> Iterator[Any]:
    """A producer transaction: a Core connection (``--api core``) or an ORM ``Session``."""
    if os.environ.get(API_VARIABLE, "core") == "session":
        with Session(engine) as session, session.begin():
            yield session
    else:
        with engine.begin() as connection:
            yield connection


def produce(engine: Any, committed: dict[uuid.UUID, float], per_transaction: int) -> None:
    """One producer transaction: ``per_transaction`` events (add_event, or add_events)."""
    with transaction(engine) as session:
        if per_transaction == 1:
            ids = [add_event(session, EVENT_TYPE, {"n": 1, "note": "benchmark"})]
        else:
            ids = add_events(
                session,
                [
                    NewEvent(EVENT_TYPE, {"n": n, "note": "benchmark"})
                    for n in range(per_transaction)
                ],
            )
    now = time.time()
    for event_id in ids:
        committed[event_id] = now


def run_threads(target: Callable[[], None], count: int) -> None:
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def open_loop(
    engine: Any, rate: float, duration: float, producers: int, per_transaction: int = 1
) -> dict[uuid.UUID, float]:
    """Offer ``rate`` events/s on a fixed schedule (late sends are not skipped)."""
    committed: dict[uuid.UUID, float] = {}
    rate /= per_transaction  # transactions per second
    total = int(rate * duration)
    start = time.perf_counter() + 0.2
    counter = iter(range(total))
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            delay = start + index / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            produce(engine, committed, per_transaction)

    run_threads(run, producers)
    return committed


def closed_loop(
    engine: Any, duration: float, producers: int, per_transaction: int
) -> dict[uuid.UUID, float]:
    committed: dict[uuid.UUID, float] = {}
    deadline = time.perf_counter() + duration

    def run() -> None:
        while time.perf_counter() < deadline:
            produce(engine, committed, per_transaction)

    run_threads(run, producers)
    return committed


def wait_processed(engine: Any, ids: Sequence[uuid.UUID], timeout: float) -> dict[str, float]:
    """Handler-done times of ``ids``, once all are done (or at the timeout).

    Polls a count, not the rows: reading every row five times a second cost Postgres and
    this process CPU that grew with the table and was charged to the run.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        with engine.connect() as conn:
            if conn.execute(text("SELECT count(*) FROM bench_e2e")).scalar_one() >= len(ids):
                break
        time.sleep(0.2)
    wanted = {str(i) for i in ids}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT event_id::text, done_at FROM bench_e2e")).all()
    return {r[0]: r[1] for r in rows if r[0] in wanted}


def reset_tables(engine: Any) -> None:
    """Start each measurement from empty tables (the pipeline is idle between them).

    Without this every mode ran on the tables its predecessors filled, so later modes
    paid for bigger tables and indexes: a bias against whatever ran second.
    """
    with engine.begin() as conn:
        conn.execute(
            text(
                "TRUNCATE bench_e2e, pipeline.outbox, pipeline.inbox, pipeline.attempts,"
                " pipeline.dead_letters"
            )
        )


def _producer_child(
    env: dict[str, str], url: str, loop: str, args: tuple[float, ...], per_tx: int, out: Any
) -> None:
    """Run producers in a process of their own, traced as the mode says (``on``: exported)."""
    for name in set(os.environ) - set(base_environment()):
        del os.environ[name]
    os.environ.update(env)
    from pipeline.observability.tracing import configure_tracing, shutdown_tracing

    settings = Settings(database_url=url)  # type: ignore[arg-type]
    configure(settings)
    configure_tracing(settings, "bench-producer")
    engine = create_engine(
        settings.sqlalchemy_url(),
        pool_size=int(args[-1]) + 2,
        connect_args={"application_name": PRODUCER_APPLICATION},
    )
    if loop == "open":
        committed = open_loop(engine, args[0], args[1], int(args[2]), per_tx)
    else:
        committed = closed_loop(engine, args[0], int(args[1]), per_tx)
    backends = backend_cpu_seconds(engine, PRODUCER_APPLICATION)
    engine.dispose()
    shutdown_tracing()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    out.put(({str(k): v for k, v in committed.items()}, cpu, backends))


def backend_cpu_seconds(engine: Any, application_name: str) -> float:
    """CPU seconds the Postgres backends of ``application_name`` used in their lifetime
    (read before they exit, so the producers' share of Postgres is not lost)."""
    with engine.connect() as conn:
        pids = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE application_name = :name"),
            {"name": application_name},
        ).scalars()
        ticks = sum(pc._processes().get(pid, ("", 0, 0))[2] for pid in pids)
    return ticks / os.sysconf("SC_CLK_TCK")


def run_producers(
    env: dict[str, str], url: str, loop: str, *args: float, per_transaction: int = 1
) -> tuple[dict[uuid.UUID, float], tuple[float, float]]:
    """Producers in a spawned process (its own tracing set-up).

    Returns commit times by event id, and the CPU seconds used by the producer process
    and by its Postgres backends.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(
        target=_producer_child, args=(env, url, loop, args, per_transaction, queue)
    )
    child.start()
    committed, cpu_seconds, backend_seconds = queue.get()
    child.join()
    return {uuid.UUID(k): v for k, v in committed.items()}, (cpu_seconds, backend_seconds)


def cpu_by_component(
    before: pc.CpuSample,
    after: pc.CpuSample,
    pipeline: Pipeline,
    producer_cpu: tuple[float, float],
    events: int,
) -> dict[str, float]:
    """CPU milliseconds per processed event, by component (where tracing's cost lands)."""
    hz = os.sysconf("SC_CLK_TCK")
    relay, workers = pipeline.processes
    roots = {relay.pid: "relay", workers.pid: "workers", os.getpid(): "benchmark (OTLP sink)"}

    def component(pid: int) -> str:
        for _ in range(20):
            if pid in roots:
                return roots[pid]
            name, ppid, _ = after.processes.get(pid, ("", 1, 0))
            if name in ("postgres", "redis-server"):
                return name
            if ppid <= 1:
                break
            pid = ppid
        return "other"

    ticks: dict[str, int] = {}
    for pid, (_, _, used) in after.processes.items():
        if pid in before.processes:
            name = component(pid)
            ticks[name] = ticks.get(name, 0) + used - before.processes[pid][2]
    split = {name: round(1000 * t / hz / max(events, 1), 3) for name, t in sorted(ticks.items())}
    split["producers"] = round(1000 * producer_cpu[0] / max(events, 1), 3)
    split["postgres (producer connections)"] = round(1000 * producer_cpu[1] / max(events, 1), 3)
    return split


def phases(
    engine: Any, committed: dict[uuid.UUID, float], done: dict[str, float]
) -> dict[str, float | None]:
    """Median time of each hop, from the rows' own timestamps (one clock on one machine).

    Commit → the relay marks it sent (``outbox.published_at``, after the broker took it)
    → the inbox claims it (``inbox.received_at``) → its handler is done (``done_at``).
    """
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT o.id::text, extract(epoch FROM o.published_at)::float8,"
                " extract(epoch FROM i.received_at)::float8"
                " FROM pipeline.outbox o JOIN pipeline.inbox i ON i.event_id = o.id"
                " WHERE i.consumer = 'e2e'"
            )
        ).all()
    marks = {r[0]: (r[1], r[2]) for r in rows}
    hops: dict[str, list[float]] = {
        "commit_to_sent": [],
        "commit_to_claimed": [],
        "claimed_to_done": [],
    }
    for event_id, commit in committed.items():
        key = str(event_id)
        if key not in marks or key not in done or marks[key][0] is None:
            continue
        sent, claimed = marks[key]
        hops["commit_to_sent"].append(sent - commit)
        hops["commit_to_claimed"].append(claimed - commit)
        hops["claimed_to_done"].append(done[key] - claimed)
    return {name: _ms(_percentile(values, 0.50)) for name, values in hops.items()}


def measure_rate(
    env: dict[str, str],
    url: str,
    engine: Any,
    rate: float,
    duration: float,
    producers: int,
    pipeline: Pipeline,
    per_transaction: int = 1,
) -> dict[str, Any]:
    """Open loop at ``rate``; also CPU per event, which at a fixed rate does not feed back
    into batch sizes as a closed loop does (so it compares observability modes best)."""
    reset_tables(engine)
    probe = speed_probe_ms()
    cpu = CpuWindow()
    committed, producer_cpu = run_producers(
        env, url, "open", rate, duration, producers, per_transaction=per_transaction
    )
    first_commit, last_commit = min(committed.values()), max(committed.values())
    done = wait_processed(engine, list(committed), timeout=60)
    cpu_per_event = cpu.per_event(pipeline, producer_cpu, len(done))
    latencies = [done[str(i)] - t for i, t in committed.items() if str(i) in done]
    lagging = [d - last_commit for d in done.values()]
    return {
        "speed_probe_ms": probe,
        "phases_ms_p50": phases(engine, committed, done),
        **cpu_per_event,
        "offered_events_per_s": rate,
        "achieved_commit_rate": round((len(committed) - 1) / (last_commit - first_commit), 1),
        "events": len(committed),
        "processed": len(done),
        "sustained": len(done) == len(committed) and max(lagging, default=0) < 2.0,
        "latency_ms": {
            "p50": _ms(_percentile(latencies, 0.50)),
            "p90": _ms(_percentile(latencies, 0.90)),
            "p99": _ms(_percentile(latencies, 0.99)),
            "max": _ms(max(latencies, default=None) if latencies else None),
        },
    }


def speed_probe_ms() -> float:
    """Milliseconds for a fixed pure-Python loop, taken before each measurement.

    This machine's speed drifts by tens of percent within an hour (shared host); runs are
    comparable only when their probes are close.
    """
    started = time.perf_counter()
    total = 0
    for n in range(2_000_000):
        total += n
    return round((time.perf_counter() - started) * 1000, 1)


def machine_busy_seconds() -> float:
    """CPU time all processes on this machine spent busy so far (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """The machine's CPU from creation to :meth:`per_event`, per processed event."""

    def __init__(self) -> None:
        self.busy = machine_busy_seconds()
        self.sample = pc._sample()

    def per_event(
        self, pipeline: Pipeline, producer_cpu: tuple[float, float], events: int
    ) -> dict[str, Any]:
        busy = machine_busy_seconds() - self.busy
        return {
            "machine_cpu_ms_per_event": round(busy * 1000 / max(events, 1), 3),
            "cpu_ms_per_event_by_component": cpu_by_component(
                self.sample, pc._sample(), pipeline, producer_cpu, events
            ),
        }


def measure_throughput(
    env: dict[str, str],
    url: str,
    engine: Any,
    duration: float,
    producers: int,
    pipeline: Pipeline,
    per_transaction: int = 1,
) -> dict[str, Any]:
    """Closed loop; also the machine's CPU per event (stabler than rates on 2 busy cores)."""
    reset_tables(engine)
    probe = speed_probe_ms()
    cpu = CpuWindow()
    started = time.time()
    committed, producer_cpu = run_producers(
        env, url, "closed", duration, producers, per_transaction=per_transaction
    )
    ended = time.time()
    done = wait_processed(engine, list(committed), timeout=120)
    cpu_per_event = cpu.per_event(pipeline, producer_cpu, len(done))
    window_start, window_end = started + 2, ended  # skip the ramp-up
    in_window = sum(1 for d in done.values() if window_start <= d <= window_end)
    finished = max(done.values(), default=ended)
    return {
        "speed_probe_ms": probe,
        "producers": producers,
        "committed": len(committed),
        "commit_rate": round(len(committed) / (ended - started), 1),
        "processed": len(done),
        "processed_per_s_in_window": round(in_window / (window_end - window_start), 1),
        "drain_seconds_after_last_commit": round(finished - ended, 2),
        "end_to_end_per_s": round(len(done) / (finished - started), 1),
        **cpu_per_event,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="500,1000")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument(
        "--events-per-transaction",
        type=int,
        default=1,
        help="events each producer transaction commits (1: add_event; more: add_events)",
    )
    parser.add_argument("--worker-processes", type=int, default=2)
    parser.add_argument("--worker-threads", type=int, default=8)
    parser.add_argument("--only", default="latency,throughput")
    parser.add_argument(
        "--observability",
        default="on",
        help=(
            "comma-separated runs: on (OTLP export + /metrics), sampled (the same, "
            "--sample-ratio of traces recorded), off (neither), tracing, metrics, "
            "default (as shipped: no OTEL_* variable, /metrics)"
        ),
    )
    parser.add_argument(
        "--sample-ratio",
        type=float,
        default=0.1,
        help="share of traces the sampled mode records (default 0.1)",
    )
    parser.add_argument(
        "--api",
        choices=("core", "session"),
        default="core",
        help=(
            "core: producers add events on a Core connection (engine.begin()) and the "
            "handler writes with exec_driver_sql; session: an ORM Session and "
            "Session.execute(text(...))"
        ),
    )
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/end_to_end.json"))
    args = parser.parse_args(argv)
    os.environ[API_VARIABLE] = args.api  # the producer child and the workers inherit it
    only = set(args.only.split(","))
    logs = Path(tempfile.mkdtemp(prefix="pipeline-e2e-logs-"))
    with servers(args.database_url, args.redis_url) as (database_url, redis_url):
        settings = Settings(database_url=database_url, redis_url=redis_url)  # type: ignore[arg-type]
        configure(settings)
        engine = create_engine(settings.sqlalchemy_url(), pool_size=args.producers + 2)
        with engine.begin() as conn:
            upgrade(conn, settings.schema_name)
            conn.execute(
                text(
                    "CREATE TABLE IF NOT EXISTS bench_e2e"
                    " (event_id uuid PRIMARY KEY, done_at float8)"
                )
            )
        sink = OtlpSink()
        results: dict[str, Any] = {}
        for mode in args.observability.split(","):
            env = observability_env(mode, sink, args.sample_ratio)
            pipeline = Pipeline(
                settings, args.worker_processes, args.worker_threads, logs / mode, env
            )
            runs: dict[str, Any] = {}
            try:
                # Long enough for every process's first span export (the batch processor
                # exports after 5 s): its one-off start-up cost is not steady state.
                reset_tables(engine)
                warm = open_loop(engine, 200, WARM_UP_SECONDS, 2)
                if len(wait_processed(engine, list(warm), timeout=60)) != len(warm):
                    raise SystemExit(f"warm-up events were not processed; see {logs}")
                if "latency" in only:
                    runs["latency"] = [
                        measure_rate(
                            env,
                            database_url,
                            engine,
                            float(rate),
                            args.duration,
                            args.producers,
                            pipeline,
                            args.events_per_transaction,
                        )
                        for rate in args.rates.split(",")
                    ]
                if "throughput" in only:
                    runs["throughput"] = measure_throughput(
                        env,
                        database_url,
                        engine,
                        args.duration,
                        args.producers,
                        pipeline,
                        args.events_per_transaction,
                    )
            finally:
                pipeline.stop()
            key, repeat = f"observability_{mode}", 2
            while key in results:  # --observability off,on,off,on: keep every run
                key, repeat = f"observability_{mode}_{repeat}", repeat + 1
            results[key] = runs
        sink.shutdown()
        engine.dispose()
        report = {
            "benchmark": "end_to_end",
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "machine": _machine(),
            "code": pc._code_version(),
            "durability": durability(database_url),
            "logs": str(logs),
            "setup": {
                "relay": "1 process, --mode auto",
                "workers": f"{args.worker_processes} processes x {args.worker_threads} threads",
                "producers": (
                    f"{args.producers} threads in one spawned process, "
                    f"{args.events_per_transaction} event(s) per transaction; with "
                    "observability on they trace (create spans, OTLP export)"
                ),
                "api": (
                    "producers: engine.begin() + add_event; handler: exec_driver_sql"
                    if args.api == "core"
                    else "producers: Session + add_event; handler: Session.execute(text())"
                ),
                "worker_timeout_ms": settings.worker_timeout_ms,
                "sampled_mode_ratio": args.sample_ratio,
            },
            "results": results,
        }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
