"""The relay: throughput, wake-up latency, producer cost with a relay running.

``python -m benchmarks.relay``, against a real durable Postgres and a real Redis.
Strategies (``--only``):

* ``throughput``: N committed outbox events (1,000 ordering keys, 2 subscribed consumers)
  drained by one inline :class:`~pipeline.relay.drain.Drainer` and, separately, by two
  drainer processes in parallel (the relay plus one publishing actor), at each of
  ``--batch-sizes``. Reports events marked sent per second, messages per second, where
  each batch's time goes (claim SQL, commits, JSON encoding, Redis round trip, mark-sent)
  and CPU shares; then checks every event is ``sent`` and on each queue exactly once.
* ``wakeup_latency``: commit -> message visible on the consumer queue, for a
  :class:`~pipeline.relay.relay.Relay` thread woken only by NOTIFY (polls every 5 s), one
  polling without LISTEN (paced and idle arrivals), and sustained loads
  (``--sustained-rates`` offered by producer processes). Each event's time is also split
  at the relay's own timestamps (wake, claim, deliver, observe), from wrappers set on the
  relay's instance. ``perf_counter`` is CLOCK_MONOTONIC on Linux: one clock throughout.
* ``producer_with_relay``: ``benchmarks.producers``' commit measurement for ``business``
  and ``outbox`` (trigger installed, no fake heartbeat) while a real
  ``python -m pipeline.tools.cli relay --mode inline`` publishes; counts the NOTIFYs
  producers sent and samples the relay's busy flag.

Without URLs it starts ``EmbeddedPostgres(durable=True)`` and ``EmbeddedRedis`` and removes
them afterwards. With a database URL it uses schema ``pipeline_bench`` (it TRUNCATEs it);
with a Redis URL a private key namespace that it deletes afterwards.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import redis
from psycopg import sql
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from benchmarks import harness, producers
from pipeline.config import Settings, configure, libpq_url
from pipeline.db.migrate import notify_channel
from pipeline.db.queries import queries_for
from pipeline.observability import metrics
from pipeline.outbox import NewEvent, add_events
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.relay.relay import Relay, Waker
from pipeline.signing import EnvelopeSigner, event_source
from pipeline.transport.publisher import Delivery
from pipeline.transport.redis import keys
from pipeline.transport.redis.broker import make_broker
from pipeline.transport.redis.publisher import DramatiqRedisPublisher

BENCH_DIR = Path(__file__).resolve().parent
BATCH_SIZES = (1, 100, 1000)
SECTIONS = ("throughput", "wakeup_latency", "producer_with_relay")


# -- shared: routes, events, checks --------------------


CONSUMERS = ("audit", "billing")  # two subscribers of EVENT_TYPE: two copies per event


EVENT_TYPE = "order.placed"


KEYS = 1000


ENVELOPE_ID = re.compile(rb'\{"specversion":"1\.0","id":"([0-9a-f-]{36})"')


SQL_NAMES = ("claim", "mark_sent")


RELAY_APP_NAME = "bench-relay"


def registry_for() -> Registry:
    """A fresh registry: every consumer in CONSUMERS subscribes to EVENT_TYPE."""
    consumers = Registry()
    for name in CONSUMERS:
        consumers.subscribe(name, [EVENT_TYPE])
    return consumers


def make_publisher(settings: Settings) -> DramatiqRedisPublisher:
    """A fresh broker and publisher (each instrumented run wraps its own instance); it signs
    as the relay does when ``PIPELINE_MESSAGE_KEY`` is set."""
    source = event_source(settings)
    signer = EnvelopeSigner.from_settings(settings, source)
    return DramatiqRedisPublisher(make_broker(settings), source, signer=signer)


@dataclass
class Context:
    """What every strategy needs: settings, the producers' Bench (admin connection), pids."""

    settings: Settings
    bench: producers.Bench
    server_pid: int | None
    redis_pid: int | None
    client: redis.Redis

    @property
    def url(self) -> str:
        return self.settings.require_database_url()

    @property
    def outbox(self) -> sql.Identifier:
        return sql.Identifier(self.settings.schema_name, "outbox")

    def reset(self) -> None:
        """Empty the outbox and relay_state (VACUUM, CHECKPOINT) and this namespace's keys."""
        self.bench.reset()
        self.clear_redis()

    def clear_redis(self) -> None:
        keys = list(self.client.scan_iter(match=f"{self.settings.redis_namespace}:*", count=1000))
        for start in range(0, len(keys), 1000):
            self.client.delete(*keys[start : start + 1000])

    def statuses(self) -> dict[str, int]:
        rows = self.bench.admin.execute(
            sql.SQL("SELECT status, count(*) FROM {} GROUP BY 1").format(self.outbox)
        ).fetchall()
        return {str(status): int(count) for status, count in rows}

    def engine(self, pool_size: int = 2) -> Engine:
        return create_engine(self.settings.sqlalchemy_url(), pool_size=pool_size, max_overflow=0)


TEMPLATE = sql.Identifier("public", "bench_relay_template")


FRESH_COLUMNS = ("seq", "txid", "created_at", "next_attempt_at")  # left to their defaults


def order_event(n: int) -> NewEvent:
    """The benchmark's event number ``n``: an order on one of KEYS ordering keys."""
    return NewEvent(
        EVENT_TYPE,
        {"order_id": n, "total": n % 10_000},
        aggregate_type="order",
        aggregate_id=str(n % KEYS),
    )


def produce_events(ctx: Context, count: int, per_transaction: int = 1000) -> float:
    """Commit ``count`` events through ``add_events`` over KEYS ordering keys; returns seconds."""
    engine = ctx.engine()
    started = time.perf_counter()
    try:
        for first in range(0, count, per_transaction):
            events = [order_event(n) for n in range(first, min(count, first + per_transaction))]
            with Session(engine) as session, session.begin():
                add_events(session, events)
    finally:
        engine.dispose()
    return time.perf_counter() - started


def make_template(ctx: Context, count: int) -> float:
    """Produce ``count`` events once with the real producer and keep a copy of the rows."""
    ctx.reset()
    elapsed = produce_events(ctx, count)
    admin = ctx.bench.admin
    admin.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(TEMPLATE))
    admin.execute(sql.SQL("CREATE UNLOGGED TABLE {} AS TABLE {}").format(TEMPLATE, ctx.outbox))
    return elapsed


def prefill(ctx: Context, count: int) -> float:
    """Commit the template's first ``count`` events into the empty outbox in seq order.

    The insert triggers number them anew (one transaction); ids, keys, payloads and
    headers are the real producer's.
    """
    columns = [
        sql.Identifier(name)
        for (name,) in ctx.bench.admin.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            (f"{ctx.settings.schema_name}.outbox",),
        ).fetchall()
        if name not in FRESH_COLUMNS
    ]
    started = time.perf_counter()
    ctx.bench.admin.execute(
        sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ORDER BY seq LIMIT %s").format(
            ctx.outbox, sql.SQL(", ").join(columns), sql.SQL(", ").join(columns), TEMPLATE
        ),
        (count,),
    )
    elapsed = time.perf_counter() - started
    ctx.bench.admin.execute(sql.SQL("ANALYZE {}").format(ctx.outbox))
    return elapsed


def verify_queues(ctx: Context, expected: int) -> dict[str, Any]:
    """Every consumer queue must hold each event once; counts messages and envelopes."""
    ns = ctx.settings.redis_namespace
    report: dict[str, Any] = {}
    for name in CONSUMERS:
        queue = registry_for().get(name).queue
        ids = ctx.client.lrange(keys.queue_key(ns, queue), 0, -1)
        event_ids: list[bytes] = []
        for start in range(0, len(ids), 1000):
            for body in ctx.client.hmget(keys.messages_key(ns, queue), ids[start : start + 1000]):
                if body is not None:
                    event_ids += ENVELOPE_ID.findall(body)
        unique = len(set(event_ids))
        report[name] = {
            "messages": len(ids),
            "envelopes": len(event_ids),
            "unique_events": unique,
            "ok": len(event_ids) == unique == expected,
        }
    return report


# -- instruments: timing and CPU without changing the relay --------------------


def latency_summary(values: Sequence[float]) -> dict[str, Any]:
    """Count, p50/p90/p99/max/mean in milliseconds of durations given in seconds."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": harness.ms(harness.percentile(values, 0.50)),
        "p90_ms": harness.ms(harness.percentile(values, 0.90)),
        "p99_ms": harness.ms(harness.percentile(values, 0.99)),
        "max_ms": harness.ms(max(values)),
        "min_ms": harness.ms(min(values)),
        "mean_ms": harness.ms(sum(values) / len(values)),
    }


def wakeups() -> dict[str, float]:
    """This process's relay wake-up counters by source (for deltas)."""
    return {
        source: metrics.relay_wakeups.labels(source)._value.get()
        for source in ("notify", "poll", "reconnect")
    }


def cpu_report(
    before: harness.CpuSample,
    after: harness.CpuSample,
    events: int,
    relay_pids: Sequence[int],
    ctx: Context,
    producer_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """The harness's CPU report with the relay's processes as "ours".

    Producer processes, when given, are reported apart and left out of ``other``;
    ``other`` is then other tenants of the machine (and this script's parent).
    """
    pids = [*relay_pids, *producer_pids]
    report = harness.cpu_report(before, after, events, pids, ctx.server_pid, "event", "relay")
    if producer_pids:
        report["relay_pct"] = harness.cpu_shares(before, after, relay_pids)
        report["producers_pct"] = harness.cpu_shares(before, after, producer_pids)
        report.pop("relay_cpu_ms_per_event", None)
    if ctx.redis_pid is not None:
        report["redis_pct"] = harness.cpu_shares(before, after, [ctx.redis_pid])
    return report


class Phases:
    """Wall time per named phase, summed over a drain."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)

        return timed

    def merge(self, other: dict[str, float]) -> None:
        for name, seconds in other.items():
            self.seconds[name] += seconds

    def report(self, batches: int, wall: float) -> dict[str, Any]:
        """Per-batch milliseconds and share of the drain's wall time of each phase."""
        s = self.seconds
        claim_sql = s["sql:claim"]
        settle_sql = s["sql:mark_sent"]
        parts = {  # the claim is one autocommit statement: no transaction of its own
            "claim_sql": claim_sql,
            "claim_python": s["claim"] - claim_sql,
            "encode_json": s["encode"],
            "redis_pipeline": s["deliver"] - s["encode"],
            "mark_sent_sql": settle_sql,
            "mark_sent_begin_commit": s["tx:mark_sent"],
            "settle_python": s["settle"] - settle_sql - s["tx:mark_sent"],
        }
        parts["other_python"] = max(0.0, wall - sum(parts.values()))
        return {
            name: {
                "ms_per_batch": round(1000 * value / batches, 3) if batches else None,
                "pct": round(100 * value / wall, 1) if wall else None,
            }
            for name, value in parts.items()
        }


class TimedConnection:
    """Delegates to a psycopg connection, timing the relay's named queries and transactions.

    ``tx:<name>`` is a transaction's BEGIN plus COMMIT (the WAL flush), named after the last
    named query run inside it.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        schema: str,
        phases: Phases,
        log: list[tuple[str, float, float]] | None = None,
    ) -> None:
        self._conn = conn
        self._phases = phases
        self._log = log  # (query name, start, end) of every query, when given
        queries = queries_for(schema)
        self._names = {id(queries[name]): name for name in SQL_NAMES}
        self._last = "other"

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        name = self._names.get(id(query), "other")
        self._last = name
        started = time.perf_counter()
        try:
            return self._conn.execute(query, params, **kwargs)
        finally:
            ended = time.perf_counter()
            self._phases.add(f"sql:{name}", ended - started)
            if self._log is not None:
                self._log.append((name, started, ended))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        started = time.perf_counter()
        inside = sum(self._phases.seconds[f"sql:{n}"] for n in (*SQL_NAMES, "other"))
        with self._conn.transaction() as tx:
            yield tx
        spent = sum(self._phases.seconds[f"sql:{n}"] for n in (*SQL_NAMES, "other")) - inside
        self._phases.add(f"tx:{self._last}", time.perf_counter() - started - spent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


# -- strategy throughput --------------------


def instrumented_drainer(
    settings: Settings,
    publisher: DramatiqRedisPublisher,
    owner: str,
    conn: psycopg.Connection[Any],
    phases: Phases,
) -> Drainer:
    """A real Drainer whose connection, claim, settle, deliver and encode are timed."""
    timed = TimedConnection(conn, settings.schema_name, phases)
    drainer = Drainer(settings, publisher, registry_for(), owner, timed)  # type: ignore[arg-type]
    drainer.claim = phases.wrap("claim", drainer.claim)  # type: ignore[method-assign]
    drainer._settle = phases.wrap("settle", drainer._settle)  # type: ignore[method-assign]
    publisher.deliver = phases.wrap("deliver", publisher.deliver)  # type: ignore[method-assign]
    publisher.encode = phases.wrap("encode", publisher.encode)  # type: ignore[method-assign]
    return drainer


def drain_until_empty(drainer: Drainer, conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Run batches until no event is pending or leased; returns (events sent, batches).

    An empty claim does not mean done when another drainer holds earlier events of
    every remaining key, so it checks for unsent rows before stopping.
    """
    unsent = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE status IN ('pending', 'publishing'))"
    ).format(sql.Identifier(drainer.settings.schema_name, "outbox"))
    sent = batches = 0
    while True:
        result = drainer.run_batch()
        if result.claimed:
            sent += result.sent
            batches += 1
            continue
        if conn.execute(unsent).fetchone() != (True,):
            return sent, batches
        time.sleep(0.001)


@dataclass(frozen=True)
class DrainerSpec:
    """One parallel drainer process; picklable because drainers are spawned."""

    database_url: str
    redis_url: str
    schema: str
    namespace: str
    batch_size: int
    owner: str


def drainer_main(spec: DrainerSpec, go: Any, finish: Any, ready: Any, results: Any) -> None:
    """Entry point of a parallel drainer process: connect, report ready, drain, report."""
    try:
        settings = Settings(
            database_url=SecretStr(spec.database_url),
            redis_url=SecretStr(spec.redis_url),
            schema_name=spec.schema,
            redis_namespace=spec.namespace,
            batch_size=spec.batch_size,
        )
        configure(settings)
        conn = psycopg.connect(spec.database_url, autocommit=True)
        phases = Phases()
        drainer = instrumented_drainer(settings, make_publisher(settings), spec.owner, conn, phases)
        ready.put(None)
    except BaseException as exc:
        ready.put(f"{type(exc).__name__}: {exc}")
        raise
    go.wait()
    started = time.perf_counter()
    sent, batches = drain_until_empty(drainer, conn)
    ended = time.perf_counter()
    results.put(
        {
            "owner": spec.owner,
            "sent": sent,
            "batches": batches,
            "started": started,
            "ended": ended,
            "phases": dict(phases.seconds),
        }
    )
    finish.wait()  # keep the connection (and its backend) until the parent sampled CPU
    conn.close()


def drain_inline(ctx: Context, batch_size: int) -> dict[str, Any]:
    """One Drainer on one connection in this process, timed from first claim to empty."""
    settings = ctx.settings.replace(batch_size=batch_size)
    phases = Phases()
    conn = psycopg.connect(ctx.url, autocommit=True)
    drainer = instrumented_drainer(settings, make_publisher(settings), "bench-inline", conn, phases)
    before = harness.sample()
    started = time.perf_counter()
    sent, batches = drain_until_empty(drainer, conn)
    wall = time.perf_counter() - started
    after = harness.sample()
    conn.close()
    drainer.publisher.close()
    return {
        "drainers": 1,
        "sent": sent,
        "batches": batches,
        "seconds": round(wall, 3),
        "phases": phases.report(batches, wall),
        "cpu": cpu_report(before, after, sent, [os.getpid()], ctx),
    }


def drain_parallel(ctx: Context, batch_size: int, count: int = 2) -> dict[str, Any]:
    """``count`` drainer processes at once (the relay plus publishing actors)."""
    specs = [
        DrainerSpec(
            ctx.url,
            ctx.settings.require_redis_url(),
            ctx.settings.schema_name,
            ctx.settings.redis_namespace,
            batch_size,
            f"bench-drainer-{n}",
        )
        for n in range(count)
    ]
    drainers = harness.Spawned(drainer_main, specs)
    try:
        before = harness.sample()
        drainers.go.set()
        collected = drainers.results(timeout=600)
        after = harness.sample()
    finally:
        drainers.close()
    wall = max(r["ended"] for r in collected) - min(r["started"] for r in collected)
    sent = sum(r["sent"] for r in collected)
    batches = sum(r["batches"] for r in collected)
    phases = Phases()
    for part in collected:
        phases.merge(part["phases"])
    pids = drainers.pids
    return {
        "drainers": count,
        "sent": sent,
        "batches": batches,
        "per_drainer_sent": [r["sent"] for r in collected],
        "seconds": round(wall, 3),
        # summed over both drainers, so shares are of 2 x wall time
        "phases": phases.report(batches, wall * count),
        "cpu": cpu_report(before, after, sent, pids, ctx),
    }


def run_throughput(
    ctx: Context, events: int, events_batch1: int, batch_sizes: Sequence[int] = BATCH_SIZES
) -> dict[str, Any]:
    """Drain a prefilled outbox at each batch size, with one and with two drainers."""
    produced_s = make_template(ctx, max(events, events_batch1))
    runs: list[dict[str, Any]] = []
    for batch_size in batch_sizes:
        count = events_batch1 if batch_size == 1 else events
        for parallel in (1, 2):
            ctx.reset()
            fill = prefill(ctx, count)
            if parallel == 1:
                run = drain_inline(ctx, batch_size)
            else:
                run = drain_parallel(ctx, batch_size)
            queues = verify_queues(ctx, count)
            statuses = ctx.statuses()
            messages = sum(q["messages"] for q in queues.values())
            run.update(
                batch_size=batch_size,
                events=count,
                prefill_s=round(fill, 2),
                events_per_s=round(run["sent"] / run["seconds"], 1),
                messages=messages,
                messages_per_s=round(messages / run["seconds"], 1),
                envelopes_per_s=round(2 * run["sent"] / run["seconds"], 1),
                statuses=statuses,
                queues=queues,
                verified=statuses == {"sent": count}
                and all(q["ok"] for q in queues.values())
                and run["sent"] == count,
            )
            runs.append(run)
            print(
                f"  throughput batch={batch_size:<5} drainers={parallel} events={count:<6} "
                f"{run['events_per_s']:>9.0f} events/s {run['messages_per_s']:>8.0f} msgs/s "
                f"verified={run['verified']}",
                flush=True,
            )
    return {
        "method": (
            f"events produced once with add_events (1,000 per transaction, {KEYS} ordering "
            f"keys order:<n % {KEYS}>, {len(CONSUMERS)} consumers subscribed) and kept as a "
            "template; per run: TRUNCATE + VACUUM + CHECKPOINT, the first N template rows "
            "committed in seq order (INSERT ... SELECT, triggers renumber them), ANALYZE, then "
            "Drainer.run_batch() timed until nothing is pending: one drainer in this "
            "process, or two spawned drainer processes started together"
        ),
        "template_produced_s": round(produced_s, 2),
        "max_events_per_message": ctx.settings.max_events_per_message,
        "consumers": list(CONSUMERS),
        "ordering_keys": KEYS,
        "runs": runs,
    }


# -- strategy wakeup_latency --------------------


class QueueObserver(threading.Thread):
    """Waits on the publisher's wake-up list and timestamps each event id reaching ``queue``.

    It pops what it reads (nothing else consumes the queue), so every read is small.
    """

    def __init__(self, settings: Settings, queue: str) -> None:
        super().__init__(name="queue-observer", daemon=True)
        ns = settings.redis_namespace
        self.client = redis.Redis.from_url(settings.require_redis_url())
        self.wake_key = keys.wake_key(ns, queue)
        self.queue_key = keys.queue_key(ns, queue)
        self.messages_key = keys.messages_key(ns, queue)
        self.seen: dict[str, float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.client.blpop([self.wake_key], timeout=0.2)
            ids = self.client.lpop(self.queue_key, 100_000)
            if not ids:
                continue
            now = time.perf_counter()
            bodies = self.client.hmget(self.messages_key, ids)
            self.client.hdel(self.messages_key, *ids)
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
        producers.sqlalchemy_url(spec.database_url), pool_size=spec.threads, max_overflow=0
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
    specs = [
        ProducerSpec(ctx.url, ctx.settings.schema_name, n, threads, rate / processes, duration)
        for n in range(processes)
    ]
    workers = harness.Spawned(producer_main, specs)
    try:
        before = harness.sample()
        workers.go.set()
        parts = workers.results(timeout=duration + 120)
        after = harness.sample()
    finally:
        workers.close()
    commits = {event_id: done for part in parts for event_id, done, _ in part}
    behind = [done - due for part in parts for _, done, due in part]
    cpu = cpu_report(before, after, len(commits), [os.getpid()], ctx, workers.pids)
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


# -- strategy producer_with_relay --------------------


class RelayMonitor:
    """Counts NOTIFYs on the outbox channel and samples the busy flag and the backlog."""

    def __init__(self, ctx: Context) -> None:
        schema = ctx.settings.schema_name
        self.listen_conn = psycopg.connect(ctx.url, autocommit=True)
        self.listen_conn.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(schema)))
        )
        self.sample_conn = psycopg.connect(ctx.url, autocommit=True)
        self.busy_query = sql.SQL(
            "SELECT coalesce(bool_or(busy AND heartbeat_at > clock_timestamp() - "
            "interval '5 seconds'), false), (SELECT count(*) FROM {} "
            "WHERE status IN ('pending', 'publishing')) FROM {}"
        ).format(sql.Identifier(schema, "outbox"), sql.Identifier(schema, "relay_state"))
        self.notifications: list[float] = []
        self.samples: list[tuple[float, bool, int]] = []
        self.halt = threading.Event()
        self.threads = [
            threading.Thread(target=self._listen, daemon=True),
            threading.Thread(target=self._sample, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _listen(self) -> None:
        while not self.halt.is_set():
            for _ in self.listen_conn.notifies(timeout=0.2):
                self.notifications.append(time.monotonic())

    def _sample(self) -> None:
        while not self.halt.wait(0.02):
            with contextlib.suppress(psycopg.Error):
                row = self.sample_conn.execute(self.busy_query).fetchone()
                if row is not None:
                    self.samples.append((time.monotonic(), bool(row[0]), int(row[1])))

    def window(self, start: float, end: float) -> dict[str, Any]:
        inside = [s for s in self.samples if start <= s[0] < end]
        return {
            "notifies": sum(1 for t in self.notifications if start <= t < end),
            "busy_fraction": (
                round(sum(1 for s in inside if s[1]) / len(inside), 3) if inside else None
            ),
            "busy_samples": len(inside),
            "backlog_max": max((s[2] for s in inside), default=None),
            "backlog_at_end": inside[-1][2] if inside else None,
        }

    def close(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(timeout=5)
        self.listen_conn.close()
        self.sample_conn.close()


def start_relay_process(ctx: Context, log: Path) -> subprocess.Popen[bytes]:
    """``python -m pipeline.tools.cli relay --mode inline`` with bench_app's route."""
    env = dict(os.environ)
    env.update(
        PIPELINE_DATABASE_URL=ctx.url,
        PIPELINE_REDIS_URL=ctx.settings.require_redis_url(),
        PIPELINE_REDIS_NAMESPACE=ctx.settings.redis_namespace,
        PIPELINE_SCHEMA_NAME=ctx.settings.schema_name,
        PIPELINE_APP_MODULES="bench_app",
        PIPELINE_METRICS_PORT="0",  # no /metrics endpoint: not on the publishing path
        PGAPPNAME=RELAY_APP_NAME,  # libpq: lets pg_stat_activity name the relay's backends
        PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_DIR), env.get("PYTHONPATH")])),
    )
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.tools.cli", "relay", "--mode", "inline"],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    relay_state = sql.Identifier(ctx.settings.schema_name, "relay_state")
    deadline = time.monotonic() + 60
    while True:
        row = ctx.bench.admin.execute(
            sql.SQL("SELECT 1 FROM {} WHERE pid = %s").format(relay_state), (process.pid,)
        ).fetchone()
        if row is not None:
            return process
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"relay process did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def settle_relay(ctx: Context, timeout: float = 20.0) -> None:
    """Drop any backlog and wait until the relay has handed off (not busy), so the next
    run's probe commit NOTIFYs as the producers expect."""
    ctx.bench.admin.execute(sql.SQL("TRUNCATE {}").format(ctx.outbox))
    busy = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE busy AND heartbeat_at > clock_timestamp() "
        "- interval '5 seconds')"
    ).format(sql.Identifier(ctx.settings.schema_name, "relay_state"))
    deadline = time.monotonic() + timeout
    while ctx.bench.admin.execute(busy).fetchone() == (True,) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)


def publish_lag(ctx: Context, wait: float = 30.0) -> dict[str, Any]:
    """Wait for the relay to finish the backlog; insert -> sent lag by the server's clock."""
    started = time.monotonic()
    pending = sql.SQL("SELECT count(*) FROM {} WHERE status IN ('pending', 'publishing')").format(
        ctx.outbox
    )
    left = -1
    while time.monotonic() - started < wait:
        row = ctx.bench.admin.execute(pending).fetchone()
        left = int(row[0]) if row else 0
        if left == 0:
            break
        time.sleep(0.1)
    row = ctx.bench.admin.execute(
        sql.SQL(
            "SELECT count(*), percentile_cont(array[0.5, 0.99]) WITHIN GROUP "
            "(ORDER BY extract(epoch FROM published_at - created_at)), "
            "max(extract(epoch FROM published_at - created_at)) "
            "FROM {} WHERE status = 'sent' AND event_type = %s"
        ).format(ctx.outbox),
        (EVENT_TYPE,),
    ).fetchone()
    count, quantiles, worst = row if row else (0, None, None)
    return {
        "drained_after_run_s": round(time.monotonic() - started, 2),
        "unsent_left": left,
        "events_sent": int(count),
        "insert_to_sent_p50_ms": harness.ms(float(quantiles[0])) if quantiles else None,
        "insert_to_sent_p99_ms": harness.ms(float(quantiles[1])) if quantiles else None,
        "insert_to_sent_max_ms": harness.ms(float(worst)) if worst is not None else None,
    }


def run_producer_with_relay(
    ctx: Context, clients_list: Sequence[int], duration: float, max_processes: int
) -> dict[str, Any]:
    """The producers' business vs outbox runs while a real relay process publishes."""
    ctx.reset()
    log = Path(tempfile.mkdtemp(prefix="relay-bench-")) / "relay.log"
    relay = start_relay_process(ctx, log)
    monitor = RelayMonitor(ctx)
    runs: list[dict[str, Any]] = []
    try:
        for clients in clients_list:
            for mode, label in (("business", "business"), ("outbox_notify", "outbox")):
                settle_relay(ctx)
                run, window = producers.run_one(
                    ctx.bench, mode, clients, max_processes, duration, ctx.server_pid
                )
                start, end, before, after = window.start, window.end, window.before, window.after
                run["mode"] = label
                run["producer_cost_mode"] = mode
                backends = [
                    int(pid)
                    for (pid,) in ctx.bench.admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                        (RELAY_APP_NAME,),
                    ).fetchall()
                ]
                run["relay"] = {
                    **monitor.window(start, end),
                    "relay_process_cpu_pct": harness.cpu_shares(before, after, [relay.pid]),
                    "relay_backends_cpu_pct": harness.cpu_shares(before, after, backends),
                }
                other = run["cpu"].get("other_pct")
                run["relay"]["other_tenants_cpu_pct"] = (
                    round(other - run["relay"]["relay_process_cpu_pct"], 1)
                    if other is not None
                    else None
                )
                run["relay"]["notifies_per_commit"] = (
                    round(run["relay"]["notifies"] / run["commits"], 4) if run["commits"] else None
                )
                if mode != "business":
                    run["relay"].update(publish_lag(ctx))
                if relay.poll() is not None:
                    raise RuntimeError(f"relay process exited: {log.read_text()[-2000:]}")
                runs.append(run)
                r = run["relay"]
                print(
                    f"  with relay {label:<9} clients={clients:<3} {run['tx_per_s']:>7.0f} tx/s "
                    f"commit p50 {run['latency_ms']['commit_p50']} ms  notifies {r['notifies']} "
                    f"busy {r['busy_fraction']} backlog max {r['backlog_max']}",
                    flush=True,
                )
    finally:
        monitor.close()
        if relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(timeout=20)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
    rate = {(r["mode"], r["clients"]): r["tx_per_s"] for r in runs}
    ratios = {
        str(c): round(rate[("outbox", c)] / rate[("business", c)], 3)
        if rate.get(("business", c))
        else None
        for c in clients_list
        if ("outbox", c) in rate
    }
    return {
        "method": (
            "producers.run_one for modes business and outbox_notify (reported as "
            "'outbox': add_event in the transaction, NOTIFY trigger installed, no fake "
            "heartbeat) while `python -m pipeline.tools.cli relay --mode inline` (routes from "
            "benchmarks/bench_app.py) publishes; before each run the outbox is truncated and "
            "the relay allowed to hand off. notifies = NOTIFYs received by a LISTEN here "
            "during the window; busy_fraction = share of 20 ms samples of relay_state in "
            "which the trigger would skip NOTIFY"
        ),
        "duration_s": duration,
        "relay_log": str(log),
        "runs": runs,
        "ratios_outbox_over_business": ratios,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="strategies")
    parser.add_argument("--output", type=Path, default=harness.RESULTS / "relay.json")
    parser.add_argument("--database-url", default=os.environ.get("PIPELINE_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("PIPELINE_REDIS_URL"))
    parser.add_argument("--events", type=int, default=50_000, help="throughput, batch >= 100")
    parser.add_argument(
        "--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="throughput batch sizes"
    )
    parser.add_argument("--events-batch1", type=int, default=1_000, help="throughput, batch 1")
    parser.add_argument("--latency-events", type=int, default=300)
    parser.add_argument("--idle-events", type=int, default=8, help="polling_idle case")
    parser.add_argument("--sustained-rates", default="200,1000", help="events/s offered")
    parser.add_argument("--sustained-duration", type=float, default=8.0)
    parser.add_argument("--duration", type=float, default=8.0, help="producer_with_relay run")
    parser.add_argument("--clients", default="1,8,32", help="producer_with_relay clients")
    parser.add_argument("--processes", type=int, default=4, help="max producer processes")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := sorted(set(sections) - set(SECTIONS)):
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(SECTIONS)}")
    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    rates = [float(r) for r in args.sustained_rates.split(",") if r.strip()]
    report = harness.header("relay", argv)
    report["machine"]["dramatiq"] = dramatiq.__version__
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(harness.servers(args.database_url, args.redis_url))
        schema = "pipeline_bench" if args.database_url else "pipeline"
        namespace = f"relaybench{uuid.uuid4().hex[:8]}" if args.redis_url else "pipeline"
        settings = Settings(
            database_url=SecretStr(libpq_url(servers.database_url)),
            redis_url=SecretStr(servers.redis_url),
            schema_name=schema,
            redis_namespace=namespace,
        )
        configure(settings)
        bench = producers.Bench(servers.database_url, schema)
        stack.callback(bench.close)
        stack.callback(bench.admin.execute, sql.SQL("DROP TABLE IF EXISTS {}").format(TEMPLATE))
        client = redis.Redis.from_url(servers.redis_url)
        stack.callback(client.close)
        ctx = Context(settings, bench, servers.postgres_pid, servers.redis_pid, client)
        if args.redis_url:
            stack.callback(ctx.clear_redis)
        bench.migrate()
        report["servers"] = servers.describe()
        report["parameters"] = {
            "strategies": sections,
            "schema": schema,
            "settings": {
                k: getattr(settings, k)
                for k in (
                    "batch_size",
                    "max_events_per_message",
                    "poll_interval_busy",
                    "poll_interval_min",
                    "poll_interval_max",
                    "lease_seconds",
                )
            },
        }
        report["complete"] = False
        runners: dict[str, Callable[[], dict[str, Any]]] = {
            "throughput": lambda: run_throughput(
                ctx,
                args.events,
                args.events_batch1,
                [int(size) for size in args.batch_sizes.split(",")],
            ),
            "wakeup_latency": lambda: run_wakeup_latency(
                ctx, args.latency_events, args.idle_events, rates, args.sustained_duration
            ),
            "producer_with_relay": lambda: run_producer_with_relay(
                ctx, clients_list, args.duration, args.processes
            ),
        }
        report["loadavg_after_section"] = {}
        for section in SECTIONS:
            if section in sections:
                report[section] = runners[section]()
                report["loadavg_after_section"][section] = os.getloadavg()
                harness.write_report(args.output, report)  # keep what ran if a later one fails
    report["complete"] = True
    return harness.done(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
