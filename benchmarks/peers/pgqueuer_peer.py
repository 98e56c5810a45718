"""pgqueuer on the end-to-end workload: a job per producer transaction, two worker processes.

The producer enqueues one job in its own asyncpg transaction (``Queries.enqueue``, as
pgqueuer's README shows for a transactional enqueue); each worker process runs
``PgQueuer`` with pgqueuer's defaults (``batch_size`` 10, LISTEN/NOTIFY wake-ups,
``durable`` tables: every table logged) and one entrypoint whose handler writes one row.
Run a worker by hand with ``python -m benchmarks.peers.pgqueuer_peer work DATABASE_URL``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence

import asyncpg
import psycopg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

from benchmarks.peers import common

NAME = "pgqueuer"
DISTRIBUTIONS = ("pgqueuer", "asyncpg")
ENTRYPOINT = "bench_e2e"
WORKER_PROCESSES = 2
PAYLOAD = json.dumps({"n": 1, "note": "benchmark"}).encode()
SETTINGS = {
    "driver": "asyncpg (AsyncpgDriver), one connection per producer task",
    "worker_processes": WORKER_PROCESSES,
    "run": "PgQueuer.run() defaults: batch_size 10, dequeue_timeout 30 s, no concurrency cap",
    "durability": "pgqueuer's default 'durable': queue, log and statistics tables logged",
    "handler": "async; time.time() on entry, one INSERT through an asyncpg pool",
}
SEMANTICS = [
    "A job queue, not an event bus: one job is handled by one entrypoint; publishing one "
    "event to several consumers means enqueueing one job per consumer.",
    "Postgres only: no broker; workers claim jobs with FOR UPDATE SKIP LOCKED and wake on "
    "LISTEN/NOTIFY.",
    "No inbox: a job retried after its handler committed runs the handler again; "
    "idempotency is the handler's own job.",
    "No per-key ordering and no event envelope or trace context carried by default.",
]


async def install(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


def reset(url: str) -> None:
    """Empty the queue and its log between measurements."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")


def commands(url: str, redis_url: str, namespace: str) -> dict[str, list[str]]:
    """Worker processes (Redis is not used)."""
    return {
        f"worker-{n}": [sys.executable, "-m", "benchmarks.peers.pgqueuer_peer", "work", url]
        for n in range(WORKER_PROCESSES)
    }


class Producer:
    """One asyncpg connection per producer task; one job per transaction."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.connections: list[asyncpg.Connection] = []
        self.queries: list[Queries] = []

    async def start(self, producers: int) -> None:
        self.connections = [await asyncpg.connect(self.url) for _ in range(producers)]
        self.queries = [Queries(AsyncpgDriver(conn)) for conn in self.connections]

    async def produce(self, slot: int) -> str:
        async with self.connections[slot].transaction():
            ids = await self.queries[slot].enqueue(ENTRYPOINT, PAYLOAD)
        return str(ids[0])

    async def stop(self) -> None:
        for conn in self.connections:
            await conn.close()


async def work(argv: Sequence[str]) -> None:
    """One worker process: ``work DATABASE_URL``."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pgqueuer").setLevel(logging.WARNING)
    url = argv[1]
    connection = await asyncpg.connect(url)
    pool = await asyncpg.create_pool(url, min_size=2, max_size=10)
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint(ENTRYPOINT)
    async def handle(job: Job) -> None:
        started = time.time()
        await common.record(pool, str(job.id), started)

    common.stop_on_sigterm(pgq.shutdown.set)
    try:
        await pgq.run()
    finally:
        await pool.close()
        await connection.close()


if __name__ == "__main__":
    common.run_async(work)
