"""Section ``throughput``: a prefilled outbox drained by one Drainer, then by two processes.

Per batch size, one inline :class:`~pipeline.relay.drain.Drainer` in this process and two
spawned drainer processes started together drain the same N events; each run reports
events and messages per second, where each batch's time went and the CPU shares, and
checks every event is ``sent`` and on each consumer queue exactly once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from pydantic import SecretStr

from benchmarks import producer_cost as pc
from benchmarks.relay_context import (
    CONSUMERS,
    KEYS,
    Context,
    join_or_kill,
    make_publisher,
    make_template,
    prefill,
    registry_for,
    verify_queues,
)
from benchmarks.relay_instruments import Phases, TimedConnection, cpu_report
from pipeline.config import Settings, configure
from pipeline.relay.drain import Drainer
from pipeline.transport.publisher import DramatiqRedisPublisher

BATCH_SIZES = (1, 100, 1000)


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
    before = pc._sample()
    started = time.perf_counter()
    sent, batches = drain_until_empty(drainer, conn)
    wall = time.perf_counter() - started
    after = pc._sample()
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
    spawn = mp.get_context("spawn")
    go, finish = spawn.Event(), spawn.Event()
    ready, results = spawn.Queue(), spawn.Queue()
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
    processes = [
        spawn.Process(target=drainer_main, args=(spec, go, finish, ready, results), daemon=True)
        for spec in specs
    ]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            error = ready.get(timeout=120)
            if error is not None:
                raise RuntimeError(f"drainer process failed to start: {error}")
        before = pc._sample()
        go.set()
        collected = [results.get(timeout=600) for _ in processes]
        after = pc._sample()
    finally:
        go.set()
        finish.set()
        join_or_kill(processes)
    wall = max(r["ended"] for r in collected) - min(r["started"] for r in collected)
    sent = sum(r["sent"] for r in collected)
    batches = sum(r["batches"] for r in collected)
    phases = Phases()
    for part in collected:
        phases.merge(part["phases"])
    pids = [p.pid for p in processes if p.pid is not None]
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
