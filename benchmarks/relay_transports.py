"""Relay throughput on each transport (Redis, RabbitMQ with publisher confirms), interleaved.

``python -m benchmarks.relay_transports --transports redis,rabbitmq,rabbitmq-cluster``

N committed outbox events (one per transaction, 1,000 ordering keys, 2 consumers) are
drained by one inline :class:`~pipeline.relay.drain.Drainer` per round and transport, the
order of the transports rotating by round. Each drain's time is split into the broker's
part (the publisher's ``deliver``: encoding, sending and, on RabbitMQ, the one confirm
round per batch) and the rest (claim and settle in Postgres). A further strategy times the
publisher alone on each RabbitMQ transport: the same batches with one confirm round per
batch (the pipeline's publisher) against one confirm per message (pika's blocking channel
in confirm mode, which is what Dramatiq's ``confirm_delivery=True`` does per enqueue).

Starts a throwaway durable Postgres and Redis (``embedded`` extra) and the RabbitMQ nodes
(:func:`benchmarks.harness.brokers`: Debian's ``rabbitmq-server``); ``--amqp-url`` names
an existing RabbitMQ instead, measured as ``rabbitmq``. Writes one JSON report
(``--output``).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pika
import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from benchmarks import harness
from pipeline import NewEvent, Settings
from pipeline.db.migrate import upgrade
from pipeline.envelope import OutboxEvent
from pipeline.outbox import add_events
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.runtime import build_runtime
from pipeline.transport.amqp.broker import physical_name
from pipeline.transport.namespace import delete_namespace
from pipeline.transport.publisher import Delivery, Publisher

WARM_UP_EVENTS = 10


def fill(engine: Any, count: int) -> None:
    for start in range(0, count, 200):
        with Session(engine) as session, session.begin():
            for i in range(start, min(count, start + 200)):
                add_events(
                    session,
                    [NewEvent("order.placed", {"n": i}, aggregate_id=f"k{i % 1000}")],
                )


class TimedPublisher:
    """The runtime's publisher, with the time spent in its ``deliver`` added up."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.seconds = 0.0

    def deliver(self, deliveries: Sequence[Delivery]) -> list[BaseException | None]:
        start = time.perf_counter()
        try:
            return self.inner.deliver(deliveries)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def clean_up(settings: Settings) -> None:
    """Delete the round's queues (RabbitMQ: through its management API)."""
    management = settings.broker_management_url
    delete_namespace(
        settings.require_broker_url(),
        settings.redis_namespace,
        management.get_secret_value() if management else None,
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
    publisher = TimedPublisher(runtime.publisher)
    try:
        drainer = Drainer(settings, publisher, routes, "bench", conn)  # type: ignore[arg-type]
        drainer.run_batch(limit=WARM_UP_EVENTS)  # connect and declare outside the timing
        publisher.seconds = 0.0
        start = time.perf_counter()
        sent = WARM_UP_EVENTS
        while True:
            result = drainer.run_batch()
            if not result.claimed:
                break
            sent += result.claimed
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
        runtime.close()
        clean_up(settings)
    return {
        "events": sent,
        "seconds": round(elapsed, 3),
        "events_per_second": round((sent - WARM_UP_EVENTS) / elapsed, 1),
        "publish_share_pct": round(100 * publisher.seconds / elapsed, 1),
    }


def confirm_strategies(settings: Settings, batches: int, per_batch: int) -> dict[str, Any]:
    """The pipeline's publisher (one confirm round a batch) against one confirm a message."""
    routes = Registry()
    routes.subscribe("audit", ["*"])
    runtime = build_runtime(settings, routes, set_global_broker=False)
    subscription = routes.all()[0]

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
        first_node = settings.require_broker_url().split(";")[0]
        connection = pika.BlockingConnection(pika.URLParameters(first_node))
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
        clean_up(settings)
    messages = batches * per_batch
    return {
        "messages": messages,
        "per_batch": per_batch,
        "one_confirm_round_per_batch_msgs_per_s": round(messages / batched, 1),
        "one_confirm_per_message_msgs_per_s": round(messages / single, 1),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--transports",
        default="redis,rabbitmq,rabbitmq-cluster",
        help="comma-separated: redis, rabbitmq (one node), rabbitmq-cluster (three nodes)",
    )
    parser.add_argument("--amqp-url", help="an existing RabbitMQ, measured as 'rabbitmq'")
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=str(harness.RESULTS / "transports" / "relay.json"))
    args = parser.parse_args(argv)
    args.transports = harness.parse_transports(args.transports)
    if not args.transports:
        parser.error("--transports names no transport")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = harness.header("relay_transports", argv)
    started = [t for t in args.transports if not (t == "rabbitmq" and args.amqp_url)]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in args.transports}
    with (
        harness.servers(None) as servers,
        harness.brokers(started, servers.redis_url) as brokers,
    ):
        if args.amqp_url:
            brokers["rabbitmq"] = harness.Broker("rabbitmq", args.amqp_url)
        report["servers"] = servers.describe()
        report["transports"] = [brokers[name].describe() for name in args.transports]
        engine = create_engine(
            "postgresql+psycopg://", creator=lambda: psycopg.connect(servers.database_url)
        )
        with engine.begin() as connection:
            upgrade(connection, "pipeline")

        def settings(name: str) -> Settings:
            return Settings(
                database_url=servers.database_url,  # type: ignore[arg-type]
                broker_url=brokers[name].url,  # type: ignore[arg-type]
                broker_management_url=brokers[name].management_url,  # type: ignore[arg-type]
                redis_namespace=f"b{uuid.uuid4().hex[:8]}",
                canary_interval=0,
            )

        for round_index in range(args.rounds):
            for name in harness.rotated(args.transports, round_index):
                rounds[name].append(drain_round(settings(name), engine, args.events))
                print(round_index + 1, name, rounds[name][-1], file=sys.stderr, flush=True)
        report["confirms"] = {
            name: confirm_strategies(settings(name), batches=20, per_batch=100)
            for name in args.transports
            if name != "redis"
        }
        engine.dispose()
    report["rounds"] = rounds
    report["summary"] = {
        name: {
            "events_per_second": harness.spread([r["events_per_second"] for r in runs]),
            "publish_share_pct": harness.spread([r["publish_share_pct"] for r in runs]),
        }
        for name, runs in rounds.items()
    }
    return harness.done(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
