"""Section ``wakeup_latency``: commit -> message visible on the consumer queue.

A real :class:`~pipeline.relay.relay.Relay` runs in a thread of this process, traced
through recording wrappers set on its instance (waker, connection, publisher); an
observer thread blocks on the publisher's wake-up list and timestamps each event id it
pops. Cases: NOTIFY only, polling (paced and idle arrivals), and sustained load from
spawned producer processes. ``perf_counter`` is CLOCK_MONOTONIC on Linux, so both ends
read one clock.
"""

from __future__ import annotations

import bisect
import contextlib
import multiprocessing as mp
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import redis
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from benchmarks import producer_cost as pc
from benchmarks.relay_context import (
    CONSUMERS,
    ENVELOPE_ID,
    Context,
    join_or_kill,
    make_publisher,
    order_event,
    registry_for,
)
from benchmarks.relay_instruments import (
    Phases,
    TimedConnection,
    cpu_report,
    latency_summary,
    wakeups,
)
from pipeline.config import Settings, configure
from pipeline.outbox import add_events
from pipeline.relay.relay import Relay, Waker
from pipeline.transport.publisher import Delivery


class QueueObserver(threading.Thread):
    """Waits on the publisher's wake-up list and timestamps each event id reaching ``queue``.

    It pops what it reads (nothing else consumes the queue), so every read is small.
    """

    def __init__(self, settings: Settings, queue: str) -> None:
        super().__init__(name="queue-observer", daemon=True)
        ns = settings.redis_namespace
        self.client = redis.Redis.from_url(settings.require_redis_url())
        self.wake_key = f"{ns}:pipeline-wake:{queue}"
        self.queue_key = f"{ns}:{queue}"
        self.seen: dict[str, float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.client.blpop([self.wake_key], timeout=0.2)
            ids = self.client.lpop(self.queue_key, 100_000)
            if not ids:
                continue
            now = time.perf_counter()
            bodies = self.client.hmget(f"{self.queue_key}.msgs", ids)
            self.client.hdel(f"{self.queue_key}.msgs", *ids)
            for body in bodies:
                for event_id in ENVELOPE_ID.findall(body or b""):
                    self.seen.setdefault(event_id.decode(), now)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=5)
        self.client.close()


class TracingWaker(Waker):
    """The relay's wake-up signal, recording when each wake-up was raised and why."""

    def __init__(self) -> None:
        super().__init__()
        self.raised: list[tuple[float, str]] = []

    def __call__(self, source: str) -> None:
        self.raised.append((time.perf_counter(), source))
        super().__call__(source)


@dataclass
class RelayTrace:
    """Timestamps (perf_counter) of a traced relay: wake-ups, queries, deliveries."""

    waker: TracingWaker
    queries: list[tuple[str, float, float]]
    deliveries: dict[str, tuple[float, float]]  # event id -> deliver() start, end


@contextlib.contextmanager
def relay_thread(settings: Settings, listen: bool) -> Iterator[tuple[Relay, RelayTrace]]:
    """A real inline Relay in a thread of this process, traced without changing its code.

    Its waker, database connection and publisher are swapped for recording wrappers
    before it starts (instance attributes only).
    """
    publisher = make_publisher(settings)
    trace = RelayTrace(TracingWaker(), [], {})
    deliver = publisher.deliver

    def traced(deliveries: Sequence[Delivery]) -> list[BaseException | None]:
        started = time.perf_counter()
        outcomes = deliver(deliveries)
        ended = time.perf_counter()
        for delivery in deliveries:
            for event in delivery.events:
                trace.deliveries.setdefault(str(event.id), (started, ended))
        return outcomes

    publisher.deliver = traced  # type: ignore[method-assign]
    relay = Relay(settings, registry_for(), publisher, mode="inline", listen=listen)
    relay.waker = trace.waker
    conn = psycopg.connect(settings.require_database_url(), autocommit=True)
    relay._conn = TimedConnection(  # type: ignore[assignment]
        conn, settings.schema_name, Phases(), trace.queries
    )
    thread = threading.Thread(target=relay.run, name="bench-relay", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while listen and not (relay.listener is not None and relay.listener.connected.is_set()):
            if time.monotonic() > deadline:
                raise RuntimeError("relay listener did not connect")
            time.sleep(0.01)
        yield relay, trace
    finally:
        relay.shutdown()
        thread.join(timeout=15)
        publisher.close()
        conn.close()


def latency_breakdown(
    commits: dict[str, float], seen: dict[str, float], trace: RelayTrace
) -> dict[str, Any]:
    """Split each event's commit -> visible time at the relay's own timestamps.

    ``wake``: commit -> start of the claim that took the event (NOTIFY delivery, listener
    thread, hand-over to the relay thread; or the wait for a poll); ``claim``: claim
    lock + claim query + COMMIT + rows -> events; ``deliver``: envelopes encoded and the
    Redis pipeline's round trip; ``observe``: deliver() returned -> the observer's LPOP
    returned. An event counts as ``notified`` when a NOTIFY wake-up was raised between
    its commit (less 5 ms: the notification can beat the producer's commit ack) and the
    start of its claim.
    """
    claim_starts = sorted(start for name, start, _ in trace.queries if name == "claim")
    notifies = sorted(t for t, source in trace.waker.raised if source == "notify")
    parts: dict[str, dict[str, list[float]]] = {
        group: defaultdict(list) for group in ("all", "notified", "not_notified")
    }
    for event_id, committed in commits.items():
        if event_id not in seen or event_id not in trace.deliveries:
            continue
        deliver_start, deliver_end = trace.deliveries[event_id]
        index = bisect.bisect_right(claim_starts, deliver_start) - 1
        if index < 0:
            continue
        claim_start = claim_starts[index]
        first = bisect.bisect_left(notifies, committed - 0.005)
        notified = first < len(notifies) and notifies[first] <= claim_start
        values = {
            "total": seen[event_id] - committed,
            "wake": claim_start - committed,
            "claim": deliver_start - claim_start,
            "deliver": deliver_end - deliver_start,
            "observe": seen[event_id] - deliver_end,
        }
        if notified:
            values["commit_to_notify"] = notifies[first] - committed
            values["notify_to_claim"] = claim_start - notifies[first]
        for group in ("all", "notified" if notified else "not_notified"):
            for name, value in values.items():
                parts[group][name].append(value)
    return {
        group: {name: latency_summary(values) for name, values in named.items()}
        for group, named in parts.items()
        if named
    }


def produce_paced(
    engine: Engine, count: int, gap: tuple[float, float], rng: random.Random
) -> dict[str, float]:
    """One event per transaction, gaps drawn from ``gap`` seconds; id -> commit time."""
    commits: dict[str, float] = {}
    due = time.perf_counter()
    with Session(engine) as session:
        for n in range(count):
            due += rng.uniform(*gap)
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            (event_id,) = add_events(session, [order_event(n)])
            session.commit()
            commits[str(event_id)] = time.perf_counter()
    return commits


@dataclass(frozen=True)
class ProducerSpec:
    """One open-loop producer process for the sustained-load case."""

    database_url: str
    schema: str
    index: int
    threads: int
    rate: float  # events/s offered by this process
    duration: float


def producer_main(spec: ProducerSpec, go: Any, finish: Any, ready: Any, results: Any) -> None:
    """Offer ``rate`` events/s (one per transaction) on a fixed schedule for ``duration`` s."""
    configure(Settings(database_url=SecretStr(spec.database_url), schema_name=spec.schema))
    engine = create_engine(
        pc._sqlalchemy_url(spec.database_url), pool_size=spec.threads, max_overflow=0
    )
    with contextlib.ExitStack() as stack:
        for _ in range(spec.threads):
            stack.enter_context(engine.connect()).exec_driver_sql("SELECT 1")
    outs: list[list[tuple[str, float, float]]] = [[] for _ in range(spec.threads)]
    holder: dict[str, float] = {}

    def work(thread: int) -> None:
        interval = spec.threads / spec.rate
        due = holder["start"] + thread * interval / spec.threads
        end = holder["start"] + spec.duration
        n = (spec.index * 64 + thread) * 1_000_000
        with Session(engine) as session:
            while due < end:
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                n += 1
                (event_id,) = add_events(session, [order_event(n)])
                session.commit()
                outs[thread].append((str(event_id), time.perf_counter(), due))
                due += interval

    ready.put(None)
    go.wait()
    holder["start"] = time.perf_counter()
    threads = [threading.Thread(target=work, args=(n,)) for n in range(spec.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put([item for out in outs for item in out])
    finish.wait()  # keep the backends until the parent sampled CPU
    engine.dispose()


def produce_sustained(
    ctx: Context, rate: float, duration: float, processes: int, threads: int
) -> tuple[dict[str, float], list[float], dict[str, Any]]:
    """Spawned producers offering ``rate`` events/s.

    Returns event id -> commit time, how late each commit was against its schedule, and
    the CPU report of the window (this process = relay + observer; the producers apart).
    """
    spawn = mp.get_context("spawn")
    go, finish = spawn.Event(), spawn.Event()
    ready, results = spawn.Queue(), spawn.Queue()
    workers = [
        spawn.Process(
            target=producer_main,
            args=(
                ProducerSpec(
                    ctx.url, ctx.settings.schema_name, n, threads, rate / processes, duration
                ),
                go,
                finish,
                ready,
                results,
            ),
            daemon=True,
        )
        for n in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        before = pc._sample()
        go.set()
        parts = [results.get(timeout=duration + 120) for _ in workers]
        after = pc._sample()
    finally:
        go.set()
        finish.set()
        join_or_kill(workers)
    commits = {event_id: done for part in parts for event_id, done, _ in part}
    behind = [done - due for part in parts for _, done, due in part]
    producer_pids = [w.pid for w in workers if w.pid is not None]
    cpu = cpu_report(before, after, len(commits), [os.getpid()], ctx, producer_pids)
    return commits, behind, cpu


def latency_case(
    ctx: Context,
    name: str,
    settings: Settings,
    listen: bool,
    produce: Callable[[], dict[str, float]],
    wait: float = 15.0,
) -> dict[str, Any]:
    """Run a relay thread and an observer while ``produce`` commits; latency per event."""
    ctx.reset()
    observer = QueueObserver(settings, registry_for().get(CONSUMERS[0]).queue)
    observer.start()
    woken = wakeups()
    with relay_thread(settings, listen) as (relay, trace):
        time.sleep(0.5)  # the start-up sweep is over; the relay is idle
        cycles = relay.cycles
        started = time.perf_counter()
        commits = produce()
        produced_s = time.perf_counter() - started
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not commits.keys() <= observer.seen.keys():
            time.sleep(0.01)
        cycles = relay.cycles - cycles
    observer.stop()
    after = wakeups()
    latencies = [observer.seen[i] - t for i, t in commits.items() if i in observer.seen]
    span = max(commits.values()) - min(commits.values()) if commits else 0.0
    result = {
        "case": name,
        "listen": listen,
        "poll_interval_min": settings.poll_interval_min,
        "poll_interval_max": settings.poll_interval_max,
        "poll_interval_busy": settings.poll_interval_busy,
        "events": len(commits),
        "produced_s": round(produced_s, 2),
        "offered_per_s": round((len(commits) - 1) / span, 1) if span > 0 else None,
        "missing": len(commits) - len(latencies),
        "latency": latency_summary(latencies),
        "relay_cycles": cycles,
        "relay_wakeups": {k: int(after[k] - woken[k]) for k in after},
        "breakdown": latency_breakdown(commits, observer.seen, trace),
    }
    print(
        f"  wakeup {name:<14} n={len(latencies):<5} p50 {result['latency'].get('p50_ms')} ms  "
        f"p99 {result['latency'].get('p99_ms')} ms  max {result['latency'].get('max_ms')} ms  "
        f"wakeups {result['relay_wakeups']}",
        flush=True,
    )
    return result


def run_wakeup_latency(
    ctx: Context, events: int, idle_events: int, rates: Sequence[float], duration: float
) -> dict[str, Any]:
    """Commit -> visible latency: notify path, polling (paced and idle), sustained load."""
    base = ctx.settings
    engine = ctx.engine()
    rng = random.Random(20_000)
    paced = (0.010, 0.030)  # mean 20 ms, jittered so arrivals do not phase-lock with polls
    cases: list[dict[str, Any]] = []
    try:
        cases.append(
            latency_case(
                ctx,
                "notify",
                base.replace(poll_interval_min=5.0, poll_interval_max=5.0),
                True,
                lambda: produce_paced(engine, events, paced, rng),
            )
        )
        cases.append(
            latency_case(
                ctx, "polling", base, False, lambda: produce_paced(engine, events, paced, rng)
            )
        )
        cases.append(
            latency_case(
                ctx,
                "polling_idle",
                base,
                False,
                lambda: produce_paced(engine, idle_events, (1.0, 3.0), rng),
            )
        )
        for rate in rates:
            behind: list[float] = []
            cpu: dict[str, Any] = {}

            def sustained(
                rate: float = rate, behind: list[float] = behind, cpu: dict[str, Any] = cpu
            ) -> dict[str, float]:
                commits, lags, used = produce_sustained(ctx, rate, duration, 2, 4)
                behind.extend(lags)
                cpu.update(used)
                return commits

            result = latency_case(ctx, f"sustained_{rate:.0f}", base, True, sustained, 60.0)
            result["offered_target_per_s"] = rate
            result["producer_behind_schedule"] = latency_summary(behind)
            result["cpu"] = cpu
            cases.append(result)
    finally:
        engine.dispose()
    return {
        "method": (
            "one event per producer transaction; commit time = perf_counter() after "
            "session.commit() returns; visible time = perf_counter() after the observer's "
            "LPOP of the consumer queue returned the message (it BLPOPs the publisher's "
            f"wake-up list); observed queue pipeline.{CONSUMERS[0]} of {len(CONSUMERS)}. "
            "notify/polling: gaps uniform 10-30 ms; polling_idle: gaps uniform 1-3 s; "
            "sustained_<rate>: 2 producer processes x 4 threads, each commit on a fixed schedule "
            "(open loop; late commits are recorded as producer_behind_schedule)"
        ),
        "clock": "time.perf_counter (CLOCK_MONOTONIC, system-wide on Linux)",
        "cases": cases,
    }
