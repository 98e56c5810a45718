"""Relay throughput on Redis and on RabbitMQ (publisher confirms), in one sitting, interleaved.

``python -m benchmarks.relay_transports --amqp-url amqp://guest:guest@127.0.0.1:5672/%2F``

N committed outbox events (one per transaction, 1,000 ordering keys, 2 consumers) are
drained by one inline :class:`~pipeline.relay.drain.Drainer` per round; rounds alternate
between the transports. On RabbitMQ each batch is one confirm round. A further strategy
times the publisher alone on RabbitMQ: the same batches with one confirm round per batch
(the pipeline's publisher) against one confirm per message (pika's blocking channel in
confirm mode, which is what Dramatiq's ``confirm_delivery=True`` does per enqueue).
Prints one JSON document. Starts a throwaway Postgres and Redis (``embedded`` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

import pika
import psycopg
from sqlalchemy import create_engine, text

from pipeline import NewEvent, Settings
from pipeline.db.migrate import upgrade
from pipeline.outbox import add_events
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.runtime import build_runtime
from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis
from pipeline.transport.amqp.broker import physical_name
from pipeline.transport.namespace import delete_namespace
from pipeline.transport.publisher import Delivery


def fill(engine: Any, count: int) -> None:
    from sqlalchemy.orm import Session

    for start in range(0, count, 200):
        with Session(engine) as session, session.begin():
            for i in range(start, min(count, start + 200)):
                add_events(
                    session,
                    [NewEvent("order.placed", {"n": i}, aggregate_id=f"k{i % 1000}")],
                )


def drain_round(settings: Settings, engine: Any, count: int) -> dict[str, float]:
    routes = Registry()
    routes.subscribe("audit", ["*"])
    routes.subscribe("billing", ["order.placed"])
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE pipeline.outbox, pipeline.inbox CASCADE"))
    fill(engine, count)
    runtime = build_runtime(settings, routes, set_global_broker=False)
    conn = psycopg.connect(settings.require_database_url(), autocommit=True)
    try:
        drainer = Drainer(settings, runtime.publisher, routes, "bench", conn)
        drainer.run_batch(limit=10)  # connect and declare outside the timing
        start = time.perf_counter()
        sent = 10
        while True:
            result = drainer.run_batch()
            if not result.claimed:
                break
            sent += result.claimed
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
        runtime.close()
        delete_namespace(settings.require_broker_url(), settings.redis_namespace)
    return {"events": sent, "seconds": elapsed, "events_per_second": (sent - 10) / elapsed}


def confirm_strategies(settings: Settings, batches: int, per_batch: int) -> dict[str, Any]:
    """The pipeline's publisher (one confirm round a batch) against one confirm a message."""
    routes = Registry()
    routes.subscribe("audit", ["*"])
    runtime = build_runtime(settings, routes, set_global_broker=False)
    subscription = routes.all()[0]
    from datetime import UTC, datetime

    from pipeline.envelope import OutboxEvent

    def event() -> OutboxEvent:
        return OutboxEvent(
            uuid.uuid4(), 1, None, None, None, "order.placed", 1, "{}", "{}", 0, datetime.now(UTC)
        )

    try:
        publisher = runtime.publisher
        publisher.deliver([Delivery(subscription, [event()])])
        start = time.perf_counter()
        for _ in range(batches):
            publisher.deliver([Delivery(subscription, [event()]) for _ in range(per_batch)])
        batched = time.perf_counter() - start
        connection = pika.BlockingConnection(pika.URLParameters(settings.require_broker_url()))
        channel = connection.channel()
        channel.confirm_delivery()
        queue = physical_name(settings.redis_namespace, subscription.queue)
        body = b'{"x": 1}'
        start = time.perf_counter()
        for _ in range(batches * per_batch):
            channel.basic_publish(
                "", queue, body, pika.BasicProperties(delivery_mode=2), mandatory=True
            )
        single = time.perf_counter() - start
        connection.close()
    finally:
        runtime.close()
        delete_namespace(settings.require_broker_url(), settings.redis_namespace)
    messages = batches * per_batch
    return {
        "messages": messages,
        "per_batch": per_batch,
        "one_confirm_round_per_batch_msgs_per_s": messages / batched,
        "one_confirm_per_message_msgs_per_s": messages / single,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--amqp-url", required=True)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, Any] = {"redis": [], "amqp": []}
    with EmbeddedPostgres(durable=True) as postgres, EmbeddedRedis() as redis_server:
        engine = create_engine(
            "postgresql+psycopg://", creator=lambda: psycopg.connect(postgres.url)
        )
        with engine.begin() as connection:
            upgrade(connection, "pipeline")
        for _ in range(args.rounds):
            for name, url in (("redis", redis_server.url), ("amqp", args.amqp_url)):
                settings = Settings(
                    database_url=postgres.url,  # type: ignore[arg-type]
                    broker_url=url,  # type: ignore[arg-type]
                    redis_namespace=f"b{uuid.uuid4().hex[:8]}",
                    canary_interval=0,
                )
                results[name].append(drain_round(settings, engine, args.events))
                print(name, results[name][-1], file=sys.stderr)
        amqp_settings = Settings(
            broker_url=args.amqp_url,  # type: ignore[arg-type]
            redis_namespace=f"b{uuid.uuid4().hex[:8]}",
            canary_interval=0,
        )
        results["confirms"] = confirm_strategies(amqp_settings, batches=20, per_batch=100)
        engine.dispose()
    for name in ("redis", "amqp"):
        rates = [r["events_per_second"] for r in results[name]]
        results[f"{name}_median_events_per_second"] = statistics.median(rates)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
