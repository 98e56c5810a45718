"""The relay benchmark's shared state: servers, routes, the events it commits, checks.

:class:`Context` is what every section gets (settings, ``producer_cost``'s admin
connection, server pids, a Redis client). Events are produced once with the real
``add_events`` and kept as a template table that each run copies into an empty outbox.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from psycopg import sql
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from benchmarks import producer_cost as pc
from pipeline.config import Settings
from pipeline.outbox import NewEvent, add_events
from pipeline.registry import Registry
from pipeline.runtime import event_source
from pipeline.transport.broker import make_broker
from pipeline.transport.publisher import DramatiqRedisPublisher

BENCH_DIR = Path(__file__).resolve().parent


CONSUMERS = ("audit", "billing")  # two subscribers of EVENT_TYPE: two copies per event


EVENT_TYPE = "order.placed"


KEYS = 1000


ENVELOPE_ID = re.compile(rb'\{"specversion":"1\.0","id":"([0-9a-f-]{36})"')


SQL_NAMES = ("claim", "mark_sent")


RELAY_APP_NAME = "bench-relay"


def join_or_kill(processes: Sequence[Any]) -> None:
    """Wait for benchmark child processes; kill any that outlive the grace period."""
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def registry_for() -> Registry:
    """A fresh registry: every consumer in CONSUMERS subscribes to EVENT_TYPE."""
    consumers = Registry()
    for name in CONSUMERS:
        consumers.subscribe(name, [EVENT_TYPE])
    return consumers


def make_publisher(settings: Settings) -> DramatiqRedisPublisher:
    """A fresh broker and publisher (each instrumented run wraps its own instance)."""
    return DramatiqRedisPublisher(make_broker(settings), event_source(settings))


@dataclass
class Context:
    """What every section needs: settings, producer_cost's Bench (admin connection), pids."""

    settings: Settings
    bench: pc.Bench
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
        key = f"{ns}:{registry_for().get(name).queue}"
        ids = ctx.client.lrange(key, 0, -1)
        event_ids: list[bytes] = []
        for start in range(0, len(ids), 1000):
            for body in ctx.client.hmget(f"{key}.msgs", ids[start : start + 1000]):
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
