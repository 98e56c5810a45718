"""What every peer shares: the handled-events table, the producer loops, the measurements.

The definitions are those of ``benchmarks/end_to_end.py``, so that a peer's numbers and
the pipeline's can sit in one table:

* a producer transaction commits one event; ``time.time()`` is taken when the commit
  has returned;
* the consumer's handler takes ``time.time()`` on entry and writes one row
  (``bench_peer``), so latency is commit → handler start, on one machine and one clock;
* open loop: a fixed schedule of ``rate`` events/s shared by the producers (a late send
  is not skipped); a rate counts as sustained when every event was handled within 2 s
  of the last commit;
* closed loop: the producers commit as fast as they can for ``duration`` seconds, and
  throughput is every event handled divided by the time from the producers' launch to
  the last handler start (the drained rate). As in ``end_to_end.py`` the window starts
  before the producer process is spawned (``first_commit_after_start_s`` says how long
  it took to start), so both count that start-up alike.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol

import psycopg

from benchmarks import harness

ROOT = harness.ROOT
HANDLED_TABLE_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_peer"
    " (key text PRIMARY KEY, started_at float8 NOT NULL, copies integer NOT NULL DEFAULT 1)"
)
RECORD_SQL = (
    "INSERT INTO bench_peer (key, started_at) VALUES ($1, $2)"
    " ON CONFLICT (key) DO UPDATE SET copies = bench_peer.copies + 1"
)
WARM_UP_RATE = 200.0
WARM_UP_SECONDS = 3.0


class Producer(Protocol):
    """One peer's producer side: ``produce`` commits one transaction holding one event."""

    async def start(self, producers: int) -> None: ...

    async def produce(self, slot: int) -> str: ...

    async def stop(self) -> None: ...


class AsyncpgPool(Protocol):
    async def execute(self, query: str, *args: object) -> str: ...


async def record(pool: AsyncpgPool, key: str, started: float) -> None:
    """The handler's one write: when it started, and how many copies it saw."""
    await pool.execute(RECORD_SQL, key, started)


def stop_on_sigterm(stop: Callable[[], None]) -> None:
    """Call ``stop`` on SIGTERM or SIGINT, from the running event loop."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)


def consumer_processes(commands: dict[str, list[str]], logs: Path) -> harness.Children:
    """A peer's consumer processes, each logging to its own file."""
    return harness.Children(commands, logs, {**os.environ, "PYTHONPATH": str(ROOT)})


async def _open_loop(
    producer: Producer, rate: float, duration: float, producers: int
) -> dict[str, float]:
    committed: dict[str, float] = {}
    counter = iter(range(int(rate * duration)))
    start = time.perf_counter() + 0.2

    async def run(slot: int) -> None:
        for index in counter:  # shared by the tasks: each takes the next send slot
            delay = start + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            key = await producer.produce(slot)
            committed[key] = time.time()

    await asyncio.gather(*(run(slot) for slot in range(producers)))
    return committed


async def _closed_loop(producer: Producer, duration: float, producers: int) -> dict[str, float]:
    committed: dict[str, float] = {}
    deadline = time.perf_counter() + duration

    async def run(slot: int) -> None:
        while time.perf_counter() < deadline:
            key = await producer.produce(slot)
            committed[key] = time.time()

    await asyncio.gather(*(run(slot) for slot in range(producers)))
    return committed


async def _produce(
    module: str, url: str, loop: str, rate: float, duration: float, producers: int
) -> dict[str, float]:
    producer: Producer = importlib.import_module(module).Producer(url)
    await producer.start(producers)
    try:
        if loop == "open":
            return await _open_loop(producer, rate, duration, producers)
        return await _closed_loop(producer, duration, producers)
    finally:
        await producer.stop()


def _producer_child(
    module: str, url: str, loop: str, rate: float, duration: float, producers: int, out: Any
) -> None:
    committed = asyncio.run(_produce(module, url, loop, rate, duration, producers))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((committed, usage.ru_utime + usage.ru_stime))


def run_producers(
    module: str, url: str, loop: str, rate: float, duration: float, producers: int
) -> tuple[dict[str, float], float]:
    """Producers in a spawned process of their own; commit times by key, and its CPU seconds."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(
        target=_producer_child, args=(module, url, loop, rate, duration, producers, queue)
    )
    child.start()
    try:
        committed, cpu = queue.get(timeout=duration + 120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if child.exitcode not in (0, None):
        raise RuntimeError(f"the producer process exited with code {child.exitcode}")
    return committed, cpu


def wait_handled(url: str, expected: int, timeout: float) -> dict[str, tuple[float, int]]:
    """Handler start time and copies by key, once ``expected`` keys are in (or at the timeout)."""
    deadline = time.time() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while time.time() < deadline:
            row = conn.execute("SELECT count(*) FROM bench_peer").fetchone()
            if row is not None and row[0] >= expected:
                break
            time.sleep(0.2)
        rows = conn.execute("SELECT key, started_at, copies FROM bench_peer").fetchall()
    return {key: (started, copies) for key, started, copies in rows}


def truncate_handled(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE bench_peer")


def create_handled_table(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(HANDLED_TABLE_DDL)


def _latency(committed: dict[str, float], handled: dict[str, tuple[float, int]]) -> dict[str, Any]:
    return harness.latency_ms([handled[k][0] - t for k, t in committed.items() if k in handled])


def measure_rate(
    module: str,
    url: str,
    reset: Callable[[str], None],
    rate: float,
    duration: float,
    producers: int,
) -> dict[str, Any]:
    """Open loop at ``rate`` events/s: latency, and whether the rate was sustained."""
    reset(url)
    truncate_handled(url)
    probe = harness.speed_probe_ms()
    busy = harness.machine_busy_seconds()
    committed, producer_cpu = run_producers(module, url, "open", rate, duration, producers)
    handled = wait_handled(url, len(committed), timeout=60)
    cpu = harness.machine_busy_seconds() - busy
    seen = [handled[k] for k in committed if k in handled]
    first, last = min(committed.values()), max(committed.values())
    lagging = [started - last for started, _ in seen]
    return {
        "speed_probe_ms": probe,
        "offered_events_per_s": rate,
        "achieved_commit_rate": round((len(committed) - 1) / max(last - first, 1e-9), 1),
        "events": len(committed),
        "processed": len(seen),
        "handled_more_than_once": sum(1 for _, copies in seen if copies > 1),
        "sustained": len(seen) == len(committed) and max(lagging, default=0) < 2.0,
        "latency_ms": _latency(committed, handled),
        "machine_cpu_ms_per_event": round(cpu * 1000 / max(len(seen), 1), 3),
        "producer_cpu_ms_per_event": round(producer_cpu * 1000 / max(len(committed), 1), 3),
    }


def measure_throughput(
    module: str,
    url: str,
    reset: Callable[[str], None],
    duration: float,
    producers: int,
) -> dict[str, Any]:
    """Closed loop: committed and handled events per second, the drain included."""
    reset(url)
    truncate_handled(url)
    probe = harness.speed_probe_ms()
    busy = harness.machine_busy_seconds()
    started = time.time()
    committed, producer_cpu = run_producers(module, url, "closed", 0.0, duration, producers)
    ended = time.time()
    handled = wait_handled(url, len(committed), timeout=180)
    cpu = harness.machine_busy_seconds() - busy
    seen = [handled[k][0] for k in committed if k in handled]
    finished = max(seen, default=ended)
    window_start = started + 2  # skip the ramp-up, as end_to_end.py does
    in_window = sum(1 for s in seen if window_start <= s <= ended)
    return {
        "speed_probe_ms": probe,
        "producers": producers,
        "committed": len(committed),
        "commit_rate": round(len(committed) / (ended - started), 1),
        "first_commit_after_start_s": round(min(committed.values(), default=ended) - started, 2),
        "processed": len(seen),
        "processed_per_s_in_window": round(in_window / (ended - window_start), 1),
        "drain_seconds_after_last_commit": round(finished - ended, 2),
        "end_to_end_per_s": round(len(seen) / max(finished - started, 1e-9), 1),
        "machine_cpu_ms_per_event": round(cpu * 1000 / max(len(seen), 1), 3),
        "producer_cpu_ms_per_event": round(producer_cpu * 1000 / max(len(committed), 1), 3),
    }


def warm_up(
    module: str, url: str, reset: Callable[[str], None], processes: harness.Children
) -> None:
    """A few seconds at a low rate, so that connections and code paths are warm."""
    reset(url)
    truncate_handled(url)
    committed, _ = run_producers(module, url, "open", WARM_UP_RATE, WARM_UP_SECONDS, 2)
    handled = wait_handled(url, len(committed), timeout=60)
    processes.check_alive()
    if len(handled) < len(committed):
        raise RuntimeError(
            f"warm-up: {len(handled)} of {len(committed)} events handled within 60 s;"
            f" see {processes.logs}"
        )


def run_async(main: Callable[[Sequence[str]], Coroutine[Any, Any, None]]) -> None:
    """The entry point of a peer's consumer process: ``python -m MODULE ROLE ARGS``."""
    asyncio.run(main(sys.argv[1:]))
