"""faststream-outbox on the end-to-end workload: outbox → relay → Redis → FastStream consumers.

The producer writes one outbox row per SQLAlchemy ``AsyncSession`` transaction
(``OutboxBroker.publish(..., session=session)``, asyncpg driver so that publish NOTIFYs).
One relay process runs the package's relay pattern: an outbox subscriber stacked under
a FastStream Redis publisher, so each row is pushed onto a Redis list and then deleted.
Two consumer processes run a FastStream ``RedisBroker`` list subscriber whose handler
writes one row. The process layout mirrors the pipeline's benchmark: one relay, two
consumer processes of eight concurrent handlers each.
Run a part by hand with ``python -m benchmarks.peers.faststream_outbox_peer
relay|consume DATABASE_URL REDIS_URL LIST``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg
import psycopg
import redis
from faststream.redis import ListSub, RedisBroker
from faststream_outbox import OutboxBroker, make_outbox_table
from sqlalchemy import MetaData
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from benchmarks.peers import common

NAME = "faststream-outbox"
DISTRIBUTIONS = ("faststream-outbox", "faststream", "asyncpg", "sqlalchemy", "redis")
QUEUE = "bench_e2e"
CONSUMER_PROCESSES = 2
CONSUMER_WORKERS = 8
RELAY = {
    "max_workers": 8,
    "fetch_batch_size": 100,
    "min_fetch_interval": 0.005,
    "max_fetch_interval": 2.0,
    "terminal_flush_batch_size": 50,
}
SETTINGS = {
    "driver": "SQLAlchemy asyncio + asyncpg (LISTEN/NOTIFY wake-ups)",
    "relay": {
        "processes": 1,
        **RELAY,
        "pattern": "@redis_publisher @outbox.subscriber: publish the row to a Redis list, "
        "then delete it",
    },
    "consumers": {
        "processes": CONSUMER_PROCESSES,
        "max_workers": CONSUMER_WORKERS,
        "subscriber": "RedisBroker list subscriber (LPOP)",
    },
    "handler": "async; time.time() on entry, one INSERT through an asyncpg pool",
}
SEMANTICS = [
    "Publishing side only: the outbox row is relayed to a broker; the consumer is a plain "
    "FastStream subscriber with no inbox, so a redelivered message runs its handler again.",
    "One outbox queue feeds one relay handler; fan-out to several consumers is the "
    "downstream broker's (here one Redis list, so one consumer group).",
    "FastStream's Redis list subscriber pops a message before handling it: a consumer "
    "that dies mid-handler loses that message (a Redis stream with a consumer group acks "
    "after handling, but FastStream 0.7 runs a stream subscriber without concurrency).",
    "Rows are leased and deleted after the relay handler returns; no per-key ordering.",
]

_metadata = MetaData()
OUTBOX = make_outbox_table(_metadata, table_name="bench_outbox")


def _engine(url: str, pool_size: int) -> AsyncEngine:
    async_url = url.replace("postgresql://", "postgresql+asyncpg://", 1)
    return create_async_engine(async_url, pool_size=pool_size, max_overflow=4)


async def install(url: str) -> None:
    engine = _engine(url, 1)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_metadata.create_all)
    finally:
        await engine.dispose()


def reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE bench_outbox")


def list_name(namespace: str) -> str:
    return f"{namespace}:bench_e2e"


def commands(url: str, redis_url: str, namespace: str) -> dict[str, list[str]]:
    module = ["-m", "benchmarks.peers.faststream_outbox_peer"]
    target = [url, redis_url, list_name(namespace)]
    processes = {"relay": [sys.executable, *module, "relay", *target]}
    for n in range(CONSUMER_PROCESSES):
        processes[f"consumer-{n}"] = [sys.executable, *module, "consume", *target]
    return processes


def cleanup_redis(redis_url: str, namespace: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.delete(list_name(namespace))
    finally:
        client.close()


class Producer:
    """An ``AsyncSession`` per transaction on a pooled asyncpg engine; one row each."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def start(self, producers: int) -> None:
        self.engine = _engine(self.url, producers + 2)
        self.broker = OutboxBroker(self.engine, outbox_table=OUTBOX, log_level=logging.WARNING)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    async def produce(self, slot: int) -> str:
        key = str(uuid.uuid4())
        async with self.sessions() as session, session.begin():
            await self.broker.publish(
                {"key": key, "n": 1, "note": "benchmark"}, queue=QUEUE, session=session
            )
        return key

    async def stop(self) -> None:
        await self.engine.dispose()


async def _serve(*brokers: Any) -> None:
    """Start the brokers (in order), wait for SIGTERM, stop them (in reverse)."""
    stop = asyncio.Event()
    common.stop_on_sigterm(stop.set)
    for broker in brokers:
        await broker.start()
    await stop.wait()
    for broker in reversed(brokers):
        await broker.stop()


async def relay(url: str, redis_url: str, target: str) -> None:
    engine = _engine(url, int(RELAY["max_workers"]) + 2)
    outbox = OutboxBroker(engine, outbox_table=OUTBOX, log_level=logging.WARNING)
    downstream = RedisBroker(redis_url, log_level=logging.WARNING)
    publisher = downstream.publisher(list=target)

    @publisher
    @outbox.subscriber(QUEUE, **RELAY)  # type: ignore[arg-type]
    async def forward(body: dict[str, Any]) -> dict[str, Any]:
        return body

    try:
        await _serve(downstream, outbox)
    finally:
        await engine.dispose()


async def consume(url: str, redis_url: str, target: str) -> None:
    pool = await asyncpg.create_pool(url, min_size=2, max_size=CONSUMER_WORKERS)
    broker = RedisBroker(redis_url, log_level=logging.WARNING)

    @broker.subscriber(list=ListSub(target), max_workers=CONSUMER_WORKERS)
    async def handle(body: dict[str, Any]) -> None:
        started = time.time()
        await common.record(pool, body["key"], started)

    try:
        await _serve(broker)
    finally:
        await pool.close()


async def main(argv: Sequence[str]) -> None:
    """``relay|consume DATABASE_URL REDIS_URL LIST``."""
    logging.basicConfig(level=logging.WARNING)
    role, url, redis_url, target = argv
    await {"relay": relay, "consume": consume}[role](url, redis_url, target)


if __name__ == "__main__":
    common.run_async(main)
