"""End to end: producer commit → handler done, through relay, broker and Dramatiq workers.

``python -m benchmarks.end_to_end``. Everything runs on this machine: a durable Postgres
(fsync on) and a Redis started here (unless URLs are given), one ``pipeline relay`` and
one ``pipeline worker`` (2 processes x 8 threads by default) whose consumer ``e2e``
makes one INSERT per event (``benchmarks/e2e_app.py``), and producer threads in a
spawned process (traced as the pipeline's own processes are) calling ``add_event`` on a
Core connection, one event per transaction (``--events-per-transaction N``:
``add_events``; ``--api session``: an ORM ``Session`` for producers and handler).
Strategies (``--only``):

* ``latency``: open-loop producers offer each of ``--rates`` for ``--duration`` seconds;
  latency = handler start - the producer's commit returning (one machine, one clock).
  A rate counts as sustained when every event is handled within 2 s of the last commit.
  Also the median time of each hop (commit → sent → inbox claim → done).
* ``throughput``: closed-loop producers commit as fast as they can for ``--duration``
  seconds; sustained throughput = every event handled / (last handled - start).
* ``idle``: nothing produced for ``--idle-seconds``: the CPU the relay, the workers and
  the servers use meanwhile, in % of one core (run it first: the figure is the pipeline's
  rest state, after the warm-up).
* ``retention``: ``throughput`` on empty tables against ``--retained-rows`` sent outbox
  events and processed inbox rows within their retention, the janitor passing every
  ``--prune-interval`` seconds (the steady state once it has caught up).
* ``profile``: ``throughput`` (or ``latency`` at ``--profile-at`` events/s; as shipped,
  one event per transaction) under
  ``py-spy record --subprocesses --gil``; every sample of the producers, the relay and
  the workers is sorted into a stage by the frames on its stack. Sampling slows the run:
  read the shares, not the rate. Needs ``pip install py-spy``.

``latency`` and ``throughput`` run once per ``--observability`` mode (``default``: as
shipped; ``off``: no tracing, no ``/metrics``; ``on``: every span exported over OTLP;
``sampled``: the same, head-sampled at ``--sample-ratio``; ``tracing`` or ``metrics``
alone), in ``--rounds`` rounds whose order rotates; with ``off`` among the modes the
report's ``summary`` gives each other mode's throughput and CPU per event as ratios to
the ``off`` run of the same round (median, mean, bootstrap 95 % interval). Every
measurement starts from empty tables and records the machine's CPU per event, split by
component, and a speed probe.

``--transports redis,rabbitmq,rabbitmq-cluster`` runs all of that on each transport in
turn, the order rotating by round: Redis, one RabbitMQ node, a three-node RabbitMQ cluster
(quorum queues, publisher confirms; nodes of Debian's ``rabbitmq-server`` started here and
kept running for the whole sitting). ``transports_summary`` gives each transport's
throughput and latency percentiles over the rounds (median, min, max).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from benchmarks import harness
from benchmarks.e2e_app import API_VARIABLE
from pipeline.config import Settings, configure
from pipeline.db.migrate import upgrade
from pipeline.outbox import NewEvent, add_event, add_events
from pipeline.tools.harness.embedded import free_port

EVENT_TYPE = "bench.e2e"
PRODUCER_APPLICATION = "pipeline-bench-producer"
WARM_UP_SECONDS = 6.0
IDLE_SETTLE_SECONDS = 10.0
TABLES = "bench_e2e, pipeline.outbox, pipeline.inbox, pipeline.attempts, pipeline.dead_letters"


def observability_env(
    mode: str, sink: harness.OtlpSink, sample_ratio: float = 0.1
) -> dict[str, str]:
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


def reset_tables(engine: Any, tables: str = TABLES) -> None:
    """Start each measurement from empty tables (the pipeline is idle between them).

    Without this every mode ran on the tables its predecessors filled, so later modes
    paid for bigger tables and indexes: a bias against whatever ran second.
    """
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables}"))


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
        ticks = sum(harness.processes().get(pid, ("", 0, 0))[2] for pid in pids)
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


def ticks_by_component(
    before: harness.CpuSample, after: harness.CpuSample, pipeline: harness.Children
) -> dict[str, int]:
    """CPU clock ticks between two samples, by component: each process counts for the
    pipeline process (relay, workers) or server it descends from."""
    roots = {process.pid: name for name, process in pipeline.processes.items()}
    roots.update(pipeline.neighbours)
    roots[os.getpid()] = "benchmark (OTLP sink)"

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
    return ticks


def cpu_by_component(
    before: harness.CpuSample,
    after: harness.CpuSample,
    pipeline: harness.Children,
    producer_cpu: tuple[float, float],
    events: int,
) -> dict[str, float]:
    """CPU milliseconds per processed event, by component (where tracing's cost lands)."""
    hz = os.sysconf("SC_CLK_TCK")
    ticks = ticks_by_component(before, after, pipeline)
    split = {name: round(1000 * t / hz / max(events, 1), 3) for name, t in sorted(ticks.items())}
    split["producers"] = round(1000 * producer_cpu[0] / max(events, 1), 3)
    split["postgres (producer connections)"] = round(1000 * producer_cpu[1] / max(events, 1), 3)
    return split


def measure_idle(pipeline: harness.Children, seconds: float) -> dict[str, Any]:
    """The CPU an idle pipeline uses, in % of one core by component: what a deployment
    pays while nothing happens (relay waiting on NOTIFY, workers waiting on the broker).

    Measured after a settling pause that lets the warm-up's last work (span exports,
    the relay's step back from polling) finish.
    """
    time.sleep(IDLE_SETTLE_SECONDS)
    hz = os.sysconf("SC_CLK_TCK")
    before = harness.sample()
    time.sleep(seconds)
    ticks = ticks_by_component(before, harness.sample(), pipeline)
    percent = {name: round(100 * t / hz / seconds, 3) for name, t in sorted(ticks.items())}
    own = sum(v for k, v in percent.items() if k in pipeline.processes)
    return {
        "seconds": seconds,
        "percent_of_one_core_by_component": percent,
        "relay_and_workers_percent_of_one_core": round(own, 3),
    }


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
    return {name: harness.ms(harness.percentile(values, 0.50)) for name, values in hops.items()}


def measure_rate(
    env: dict[str, str],
    url: str,
    engine: Any,
    rate: float,
    duration: float,
    producers: int,
    pipeline: harness.Children,
    per_transaction: int = 1,
) -> dict[str, Any]:
    """Open loop at ``rate``; also CPU per event, which at a fixed rate does not feed back
    into batch sizes as a closed loop does (so it compares observability modes best)."""
    reset_tables(engine)
    probe = harness.speed_probe_ms()
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
        "latency_ms": harness.latency_ms(latencies),
    }


class CpuWindow:
    """The machine's CPU from creation to :meth:`per_event`, per processed event."""

    def __init__(self) -> None:
        self.busy = harness.machine_busy_seconds()
        self.sample = harness.sample()

    def per_event(
        self, pipeline: harness.Children, producer_cpu: tuple[float, float], events: int
    ) -> dict[str, Any]:
        busy = harness.machine_busy_seconds() - self.busy
        return {
            "machine_cpu_ms_per_event": round(busy * 1000 / max(events, 1), 3),
            "cpu_ms_per_event_by_component": cpu_by_component(
                self.sample, harness.sample(), pipeline, producer_cpu, events
            ),
        }


def measure_throughput(
    env: dict[str, str],
    url: str,
    engine: Any,
    duration: float,
    producers: int,
    pipeline: harness.Children,
    per_transaction: int = 1,
    keep_tables: bool = False,
) -> dict[str, Any]:
    """Closed loop; also the machine's CPU per event (stabler than rates on 2 busy cores).

    ``keep_tables``: leave the pipeline's tables as they are (``retention``).
    """
    reset_tables(engine, "bench_e2e" if keep_tables else TABLES)
    probe = harness.speed_probe_ms()
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


# -- the pipeline under test --------------------------------------------------------------


def start_pipeline(
    settings: Settings, args: argparse.Namespace, logs: Path, extra_env: dict[str, str]
) -> harness.Children:
    """A ``pipeline relay`` and a ``pipeline worker`` process for the benchmark consumer."""
    env = base_environment()
    env.update(
        PIPELINE_DATABASE_URL=settings.require_database_url(),
        PIPELINE_BROKER_URL=settings.require_broker_url(),
        **management_env(settings),
        PIPELINE_APP_MODULES="benchmarks.e2e_app",
        PYTHONPATH=str(harness.ROOT),
        PIPELINE_LOG_LEVEL="WARNING",
        PIPELINE_CANARY_INTERVAL="0",
    )
    env.update(extra_env)
    cli = [sys.executable, "-m", "pipeline.tools.cli"]
    workers = ["--processes", str(args.worker_processes), "--threads", str(args.worker_threads)]
    return harness.Children(
        {"relay": [*cli, "relay"], "workers": [*cli, "worker", *workers]}, logs, env
    )


def management_env(settings: Settings) -> dict[str, str]:
    """RabbitMQ's management API for the relay and workers, where not the default one."""
    management = settings.broker_management_url
    return {"PIPELINE_BROKER_MANAGEMENT_URL": management.get_secret_value()} if management else {}


@contextmanager
def running_pipeline(
    settings: Settings, args: argparse.Namespace, engine: Any, logs: Path, env: dict[str, str]
) -> Iterator[harness.Children]:
    """The pipeline started and warmed up: long enough for every process's first span
    export (the batch processor exports after 5 s), a one-off cost that is not steady state.
    """
    pipeline = start_pipeline(settings, args, logs, env)
    try:
        reset_tables(engine, "bench_e2e")
        warm = open_loop(engine, 200, WARM_UP_SECONDS, 2)
        if len(wait_processed(engine, list(warm), timeout=120)) != len(warm):
            raise SystemExit(f"warm-up events were not processed; see {logs}")
        yield pipeline
    finally:
        pipeline.stop()


# -- strategies ---------------------------------------------------------------------------


def result_key(transport: str, mode: str) -> str:
    """A run's key in the report: ``observability_<mode>``, prefixed by a RabbitMQ transport."""
    return f"observability_{mode}" if transport == "redis" else f"{transport}_observability_{mode}"


def neighbours(brokers: dict[str, harness.Broker], used: str) -> dict[int, str]:
    """The RabbitMQ nodes' CPU: the transport measured, or idle beside it."""
    named = {}
    for name, broker in brokers.items():
        label = "rabbitmq" if name == used else f"{name} (idle, not measured)"
        named.update(dict.fromkeys(broker.node_pids(), label))
    return named


def observability_runs(
    args: argparse.Namespace,
    settings: dict[str, Settings],
    brokers: dict[str, harness.Broker],
    engine: Any,
    logs: Path,
) -> dict[str, Any]:
    """``latency`` and ``throughput`` per transport and observability mode, the order of
    both rotating by round."""
    url = settings[args.transports[0]].require_database_url()
    sink = harness.OtlpSink()
    modes = args.observability.split(",")
    results: dict[str, Any] = {}
    by_round: list[dict[str, dict[str, Any]]] = []
    by_transport: dict[str, list[dict[str, Any]]] = {name: [] for name in args.transports}
    for round_index in range(args.rounds):
        for transport in harness.rotated(args.transports, round_index):
            this_round: dict[str, dict[str, Any]] = {}
            for mode in harness.rotated(modes, round_index):
                env = observability_env(mode, sink, args.sample_ratio)
                base_key = result_key(transport, mode)
                log_dir = logs / f"{base_key}-{round_index}"
                with running_pipeline(settings[transport], args, engine, log_dir, env) as p:
                    p.neighbours = neighbours(brokers, transport)
                    runs = measure_runs(args, env, url, engine, p)
                key, repeat = base_key, 2
                while key in results:  # --observability off,on,off,on or --rounds: keep all
                    key, repeat = f"{base_key}_{repeat}", repeat + 1
                results[key] = this_round[mode] = runs
                if mode == modes[0]:
                    by_transport[transport].append(runs)
                print(f"  {key}: {summarise_run(runs)}", flush=True)
            by_round.append(this_round)
    sink.shutdown()
    out: dict[str, Any] = {"results": results}
    if "off" in modes and len(modes) > 1 and "throughput" in args.only:
        out["summary"] = against_off(
            [{m: r["throughput"] for m, r in rnd.items()} for rnd in by_round]
        )
    if len(args.transports) > 1:
        out["transports_summary"] = transports_summary(by_transport, modes[0])
    return out


def measure_runs(
    args: argparse.Namespace,
    env: dict[str, str],
    url: str,
    engine: Any,
    pipeline: harness.Children,
) -> dict[str, Any]:
    """The strategies of one run on a started pipeline: idle, latency at each rate,
    throughput."""
    runs: dict[str, Any] = {}
    if "idle" in args.only:  # first: the rest state right after the warm-up
        runs["idle"] = measure_idle(pipeline, args.idle_seconds)
    if "latency" in args.only:
        runs["latency"] = [
            measure_rate(
                env,
                url,
                engine,
                float(rate),
                args.duration,
                args.producers,
                pipeline,
                args.events_per_transaction,
            )
            for rate in args.rates.split(",")
        ]
    if "throughput" in args.only:
        runs["throughput"] = measure_throughput(
            env,
            url,
            engine,
            args.duration,
            args.producers,
            pipeline,
            args.events_per_transaction,
        )
    return runs


def transports_summary(by_transport: dict[str, list[dict[str, Any]]], mode: str) -> dict[str, Any]:
    """Each transport's figures over the rounds (median, min, max), in the first mode."""
    summary: dict[str, Any] = {"observability_mode": mode}
    for transport, rounds in by_transport.items():
        figures: dict[str, Any] = {"rounds": len(rounds)}
        if rounds and "throughput" in rounds[0]:
            throughput = [r["throughput"] for r in rounds]
            figures["throughput_events_per_s"] = harness.spread(
                [t["end_to_end_per_s"] for t in throughput]
            )
            figures["machine_cpu_ms_per_event"] = harness.spread(
                [t["machine_cpu_ms_per_event"] for t in throughput]
            )
        for index, point in enumerate(rounds[0].get("latency", []) if rounds else []):
            points = [r["latency"][index] for r in rounds]
            figures[f"latency_at_{point['offered_events_per_s']:g}_per_s"] = {
                "p50_ms": harness.spread([x["latency_ms"]["p50"] for x in points]),
                "p99_ms": harness.spread([x["latency_ms"]["p99"] for x in points]),
                "sustained": [x["sustained"] for x in points],
                "phases_ms_p50_by_round": [x["phases_ms_p50"] for x in points],
            }
        summary[transport] = figures
    return summary


def summarise_run(runs: dict[str, Any]) -> str:
    parts = []
    if "throughput" in runs:
        t = runs["throughput"]
        parts.append(
            f"{t['end_to_end_per_s']} events/s, {t['machine_cpu_ms_per_event']} ms CPU/event"
        )
    if "idle" in runs:
        parts.append(f"idle {runs['idle']['relay_and_workers_percent_of_one_core']} % of a core")
    for point in runs.get("latency", []):
        lat = point["latency_ms"]
        parts.append(f"{point['offered_events_per_s']:g}/s p50 {lat['p50']} p99 {lat['p99']} ms")
    return "; ".join(parts)


# What each ratio divides: events handled per second from the first commit until the last
# event is handled (the whole run), handled within the producing window (sensitive to a
# backlog left at its end), and the machine's CPU per event.
MEASURES = {
    "end_to_end_throughput_ratio": "end_to_end_per_s",
    "in_window_throughput_ratio": "processed_per_s_in_window",
    "cpu_per_event_ratio": "machine_cpu_ms_per_event",
}


def against_off(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: each measure as a ratio to the ``off`` run of the same round."""
    summary: dict[str, Any] = {}
    for mode in [mode for mode in rounds[0] if mode != "off"]:
        summary[mode] = {"rounds": len(rounds)}
        for name, field in MEASURES.items():
            summary[mode][name] = harness.ratios([r[mode][field] / r["off"][field] for r in rounds])
        summary[mode]["within_10_percent_shown"] = {
            name: summary[mode][name]["ci95_of_mean"][0] >= 0.90
            for name in MEASURES
            if name.endswith("throughput_ratio")
        }
    summary["off"] = {
        field: [r["off"][field] for r in rounds] for field in (*MEASURES.values(), "speed_probe_ms")
    }
    return summary


def retention(
    args: argparse.Namespace, settings: Settings, engine: Any, logs: Path
) -> dict[str, Any]:
    """Throughput on empty tables, then with ``--retained-rows`` kept, per round."""
    url = settings.require_database_url()
    env = observability_env("default", harness.OtlpSink(), args.sample_ratio)
    env["PIPELINE_PRUNE_INTERVAL_SECONDS"] = str(args.prune_interval)
    rounds: list[dict[str, Any]] = []
    for number in range(args.rounds):
        for scenario in ("empty", "full"):
            reset_tables(engine)
            filled = (
                harness.seed_sent_rows(url, args.retained_rows, "1 hour", "500 microseconds")
                if scenario == "full"
                else 0.0
            )
            with running_pipeline(settings, args, engine, logs / f"{scenario}-{number}", env) as p:
                result = measure_throughput(
                    env, url, engine, args.duration, args.producers, p, keep_tables=True
                )
            result.update(scenario=scenario, round=number + 1, fill_seconds=round(filled, 1))
            figures = summarise_run({"throughput": result})
            print(f"  retention round {number + 1} {scenario}: {figures}", flush=True)
            rounds.append(result)
    return {
        "setup": (
            f"janitor every {args.prune_interval:g}s (nothing expired: it scans and finds no "
            f"work); full tables: {args.retained_rows} sent outbox events + as many processed "
            "inbox rows, one hour old"
        ),
        "rounds": rounds,
        "full_to_empty_throughput_ratios": [
            round(full["processed_per_s_in_window"] / empty["processed_per_s_in_window"], 3)
            for empty, full in zip(rounds[::2], rounds[1::2], strict=True)
            if empty["processed_per_s_in_window"]
        ],
    }


# (stage, frame substrings): a sample goes to the first stage one of whose substrings
# appears in one of its frames.
STAGES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "producers": [
        ("add_event: validate, serialise, ids, create span", ("prepare_rows",)),
        ("add_event: the INSERT (SQLAlchemy exec_driver_sql + psycopg)", ("exec_driver_sql",)),
        ("add_event: the rest (settings, backlog gate, session.connection)", ("add_events",)),
        (
            "the caller's transaction: begin, commit (SQLAlchemy + psycopg)",
            (
                "Session",
                "TransactionalContext",
                "_StateChange",
                "Engine.begin",
                "Engine.connect",
                "Connection.begin",
                "Connection.__init__",
                "Connection.close",
                "_ConnectionFairy",
                "commit",
            ),
        ),
        ("benchmark loop", ("produce", "closed_loop")),
    ],
    "workers": [
        ("handler (benchmark code: one INSERT)", ("_run_handler",)),
        ("inbox claim statement", ("_claim_all",)),
        ("metrics (prometheus_client)", ("record_processed", "prometheus_client")),
        ("tracing (process span)", ("process_span",)),
        ("envelope decoding (json)", ("decode_envelope",)),
        ("inbox transaction: session, begin, commit", ("InboxProcessor.handle",)),
        # Dramatiq's ConsumerThread runs either broker's consumer: RabbitMQ's (pika) first.
        ("Dramatiq on RabbitMQ: fetch, ack (pika)", ("RabbitmqConsumer", "pika")),
        ("Dramatiq: fetch from Redis", ("ConsumerThread", "WakeableRedisConsumer")),
        ("Dramatiq: ack, middleware, dispatch", ("WorkerThread", "Broker.emit")),
    ],
    "relay": [
        ("claim statement", ("Drainer.claim",)),
        ("RabbitMQ: publish and wait for confirms (pika)", ("_publish (", "pika")),
        ("envelope encoding (json)", ("encode",)),
        ("Redis pipeline", ("_enqueue", "Pipeline.execute")),
        ("mark sent / outcomes", ("_settle", "_record_outcome")),
        ("rest of a batch", ("run_batch",)),
        ("loop, ledger sweep, janitor, metrics", ("Relay.", "Janitor", "ledger")),
        ("LISTEN thread", ("Listener",)),
    ],
}


def process_of(stack: str) -> str | None:
    """Which benchmark process a sample came from (by its command line in the stack)."""
    if "pipeline.tools.cli relay" in stack:
        return "relay"
    if "dramatiq pipeline.worker" in stack:
        return "workers"
    if "spawn_main" in stack and "produce" in stack:
        return "producers"
    return None


def stage_of(process: str, frames: Sequence[str]) -> str:
    if not frames:
        return "no Python frame (C code holding the GIL)"
    for stage, needles in STAGES[process]:
        if any(needle in frame for frame in frames for needle in needles):
            return stage
    return "other"


def split_samples(lines: Iterable[str]) -> dict[str, Any]:
    """Samples per process and stage, from py-spy's ``raw`` (collapsed stack) output."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        stack, _, number = line.rstrip().rpartition(" ")
        if not number.isdigit() or "importlib" in stack:
            continue
        process = process_of(stack)
        if process is None:
            continue
        frames = [frame for frame in stack.split(";") if not frame.startswith("process ")]
        counts[process][stage_of(process, frames)] += int(number)
    result: dict[str, Any] = {}
    for process, stages in sorted(counts.items()):
        total = sum(stages.values())
        result[process] = {
            "samples": total,
            "share_pct": {
                stage: round(100 * count / total, 1) for stage, count in stages.most_common()
            },
        }
    return result


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """This benchmark's ``throughput`` under py-spy; samples sorted into stages."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("profile: py-spy is not installed (pip install py-spy)")
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-profile-"))
    samples = workdir / "samples.txt"
    load = ["throughput"] if not args.profile_at else ["latency", "--rates", str(args.profile_at)]
    benchmark = [sys.executable, "-m", "benchmarks.end_to_end", "--only", *load]
    benchmark += ["--api", args.api, "--events-per-transaction", "1"]
    benchmark += ["--observability", "default", "--duration", str(args.duration)]
    benchmark += ["--transports", args.transports[0]]
    benchmark += ["--output", str(workdir / "end_to_end.json")]
    command = [py_spy, "record", "--subprocesses", "--gil", "--nonblocking"]
    command += ["--rate", str(args.profile_rate), "--format", "raw", "-o", str(samples), "--"]
    subprocess.run(command + benchmark, check=True, cwd=harness.ROOT, stdout=subprocess.DEVNULL)
    run = harness.json_file(workdir / "end_to_end.json")["results"][
        result_key(args.transports[0], "default")
    ]
    sampled = run["latency"][0] if args.profile_at else run["throughput"]
    split = split_samples(samples.read_text().splitlines())
    for process, figures in split.items():
        print(f"{process} ({figures['samples']} samples)")
        for stage, share in figures["share_pct"].items():
            print(f"  {share:5.1f} %  {stage}")
    loop = f"an open loop at {args.profile_at} events/s" if args.profile_at else "closed loop"
    return {
        "method": (
            f"py-spy --gil samples of an end_to_end run, {loop} (one event per "
            f"transaction, --api {args.api}, as shipped, on {args.transports[0]}); shares of "
            "each process's samples"
        ),
        "cpu_ms_per_event_by_component_while_sampled": sampled["cpu_ms_per_event_by_component"],
        "split": split,
    }


STRATEGIES = ("latency", "throughput", "idle", "retention", "profile")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", default="latency,throughput", help=", ".join(STRATEGIES))
    parser.add_argument("--rates", default="200,1000", help="latency: events/s offered")
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
    parser.add_argument(
        "--observability",
        default="default",
        help="comma-separated modes: default, off, on, sampled, tracing, metrics",
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the order rotating")
    parser.add_argument("--sample-ratio", type=float, default=0.1, help="the sampled mode's")
    parser.add_argument(
        "--api",
        choices=("core", "session"),
        default="core",
        help="core: engine.begin() and exec_driver_sql; session: an ORM Session",
    )
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle: window")
    parser.add_argument("--retained-rows", type=int, default=5_000_000, help="retention")
    parser.add_argument("--prune-interval", type=float, default=10.0, help="retention")
    parser.add_argument("--profile-rate", type=int, default=250, help="py-spy samples/s")
    parser.add_argument(
        "--profile-at",
        type=int,
        default=0,
        help="profile: an open loop at this many events/s (0: the closed loop)",
    )
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--transports",
        default="redis",
        help="comma-separated, measured in turn: redis, rabbitmq (one node started here), "
        "rabbitmq-cluster (three nodes started here)",
    )
    parser.add_argument("--output", default=str(harness.RESULTS / "end_to_end.json"))
    args = parser.parse_args(argv)
    args.transports = harness.parse_transports(args.transports)
    if not args.transports:
        parser.error("--transports names no transport")
    args.only = [s for s in args.only.split(",") if s]
    if unknown := sorted(set(args.only) - set(STRATEGIES)):
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if "profile" in args.only and args.only != ["profile"]:
        parser.error("profile runs the benchmark under py-spy: run it on its own")
    if len(args.transports) > 1 and {"profile", "retention"} & set(args.only):
        parser.error("profile and retention run on one transport: name one in --transports")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ[API_VARIABLE] = args.api  # the producer child and the workers inherit it
    report = harness.header("end_to_end", argv)
    if args.only == ["profile"]:
        report["profile"] = profile(args)
        harness.write_report(args.output, report)
        return 0
    logs = Path(tempfile.mkdtemp(prefix="pipeline-e2e-logs-"))
    with (
        harness.servers(args.database_url, args.redis_url) as servers,
        harness.brokers(args.transports, servers.redis_url) as brokers,
    ):
        by_transport = {
            name: Settings(
                database_url=servers.database_url,  # type: ignore[arg-type]
                broker_url=broker.url,  # type: ignore[arg-type]
                broker_management_url=broker.management_url,  # type: ignore[arg-type]
            )
            for name, broker in brokers.items()
        }
        settings = by_transport[args.transports[0]]
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
        report["servers"] = servers.describe()
        report["transports"] = [broker.describe() for broker in brokers.values()]
        report["durability"] = report["servers"]["postgres_settings"]
        report["logs"] = str(logs)
        report["setup"] = {
            "relay": "1 process, --mode auto",
            "workers": f"{args.worker_processes} processes x {args.worker_threads} threads",
            "producers": (
                f"{args.producers} threads in one spawned process, "
                f"{args.events_per_transaction} event(s) per transaction"
            ),
            "api": (
                "producers: engine.begin() + add_event; handler: exec_driver_sql"
                if args.api == "core"
                else "producers: Session + add_event; handler: Session.execute(text())"
            ),
            "worker_timeout_ms": settings.worker_timeout_ms,
            "sampled_mode_ratio": args.sample_ratio,
        }
        if {"latency", "throughput", "idle"} & set(args.only):
            report.update(observability_runs(args, by_transport, brokers, engine, logs))
            harness.write_report(args.output, report)
        if "retention" in args.only:
            report["retention"] = retention(args, settings, engine, logs)
        engine.dispose()
    return harness.done(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
