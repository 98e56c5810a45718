"""The RabbitMQ transport against a real RabbitMQ: quorum queues, confirms, retries, garbage.

Uses ``PIPELINE_TEST_AMQP_URL`` or a RabbitMQ node the tests start (Debian's
``rabbitmq-server``); every test skips with one line where neither is there. Each test has
a queue namespace of its own.
The checks that need the management API (a queue policy, queue types as listed) skip
where it is not enabled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions
import pytest
from dramatiq.common import q_name
from sqlalchemy import Engine, create_engine, text

from pipeline import NewEvent, Settings, configure
from pipeline.envelope import OutboxEvent
from pipeline.errors import PublisherUnavailable, ServiceUnavailableError
from pipeline.registry import Registry
from pipeline.runtime import build_runtime
from pipeline.transport.amqp.broker import dead_queue_arguments, physical_name, queue_arguments
from pipeline.transport.amqp.management import Management
from pipeline.transport.amqp.transport import AmqpTransport
from pipeline.transport.base import QueueDepth, delay_queue_name
from pipeline.transport.factory import open_transport
from pipeline.transport.publisher import Delivery
from tests.integration.conftest import drainer_for
from tests.integration.test_inbox import TABLES
from tests.integration.test_queue_garbage import dead_letters
from tests.support import (
    app_registry,
    engine_with_tables,
    pipeline_env,
    produce,
    queue_messages,
    run_cli,
    running_pipeline,
    running_worker,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.inbox_app"
PROCESSED = "SELECT count(*) FROM pipeline.inbox WHERE status = 'processed'"


@pytest.fixture
def amqp_engine(amqp_settings: Settings) -> Iterator[Engine]:
    with engine_with_tables(amqp_settings, TABLES) as value:
        yield value


@pytest.fixture
def fast_settings(amqp_settings: Settings) -> Iterator[Settings]:
    value = amqp_settings.replace(lease_seconds=3.0, poll_interval_max=0.5)
    configure(value)
    yield value
    configure(amqp_settings)


def scalar(engine: Engine, sql: str) -> object:
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def management(settings: Settings) -> Management:
    client = Management.for_settings(settings)
    try:
        client.nodes()
    except ServiceUnavailableError as exc:
        pytest.skip(f"RabbitMQ management API not enabled: {exc}")
    return client


def amqp_channel(settings: Settings) -> tuple[pika.BlockingConnection, object]:
    connection = pika.BlockingConnection(pika.URLParameters(settings.require_broker_url()))
    return connection, connection.channel()


def assert_quorum(settings: Settings, queue: str) -> None:
    """Declaring the server's queue as classic (its other arguments as the broker declares
    them) must be refused: it is a quorum queue."""
    if queue.endswith(".XQ"):
        arguments = dead_queue_arguments()
    else:
        arguments = queue_arguments(settings.redis_namespace, q_name(queue))
    connection, channel = amqp_channel(settings)
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            channel.queue_declare(  # type: ignore[attr-defined]
                queue=physical_name(settings.redis_namespace, queue),
                durable=True,
                arguments={**arguments, "x-queue-type": "classic"},
            )
        assert refused.value.reply_code == 406
        assert "x-queue-type" in refused.value.reply_text
    finally:
        connection.close()


def test_events_flow_end_to_end_through_quorum_queues(amqp_engine, fast_settings):
    orders = [f"o-{i}" for i in range(40)]
    with running_pipeline(fast_settings, APP, threads=4):
        produce(amqp_engine, [NewEvent("entry.booked", {"order_id": o}) for o in orders])
        wait_until(
            lambda: scalar(amqp_engine, "SELECT count(*) FROM effects") == len(orders),
            timeout=60,
            progress=lambda: scalar(amqp_engine, "SELECT count(*) FROM effects"),
        )
    with amqp_engine.connect() as conn:
        done = Counter(r[0] for r in conn.execute(text("SELECT order_id FROM effects")))
        unsent = conn.execute(text("SELECT count(*) FROM pipeline.outbox WHERE status <> 'sent'"))
        assert unsent.scalar() == 0
    assert done == Counter({o: 1 for o in orders})
    status = run_cli(["status"], pipeline_env(fast_settings, APP))
    assert status.returncode == 0, status.stderr
    assert "queues (messages ready / delayed / dead):" in status.stdout
    assert "  pipeline.ledger: 0 / 0 / 0" in status.stdout, status.stdout
    for queue in ("pipeline.ledger", "pipeline.publish"):
        assert_quorum(fast_settings, queue)
        assert_quorum(fast_settings, delay_queue_name(queue))
        assert_quorum(fast_settings, f"{queue}.XQ")
    try:
        listed = Management.for_settings(fast_settings).queues()
    except ServiceUnavailableError:
        return  # the declarations above proved the type already
    ours = [q for q in listed if q["name"].startswith(f"{fast_settings.redis_namespace}.")]
    assert len(ours) >= 6
    assert {q["type"] for q in ours} == {"quorum"}, ours
    assert not any("x-max-priority" in q.get("arguments", {}) for q in ours)


def test_a_confirm_ends_the_publishers_wait_at_once(amqp_settings, consumers, monkeypatch):
    """The publisher waits for confirms in slices; a confirm must end the slice, not the
    slice's end. With a 120 s slice, a batch that waited the slice out would still hang."""
    from pipeline.transport.amqp import publisher as amqp_publisher

    monkeypatch.setattr(amqp_publisher, "CONFIRM_WAIT_SLICE", 120.0)
    runtime = build_runtime(amqp_settings, consumers, set_global_broker=False)
    subscription = consumers.all()[0]
    produced = threading.Event()

    def publish() -> None:
        for count in (1, 10, 100):
            deliveries = [Delivery(subscription, [outbox_event()]) for _ in range(count)]
            assert runtime.publisher.deliver(deliveries) == [None] * count
        produced.set()

    worker = threading.Thread(target=publish, daemon=True)
    try:
        worker.start()
        assert produced.wait(timeout=60), "the publisher waited out its slice for a confirm"
        assert len(queue_messages(amqp_settings, subscription.queue)) == 111
    finally:
        worker.join(timeout=130)
        runtime.close()


def outbox_event() -> OutboxEvent:
    return OutboxEvent(
        uuid.uuid4(), 1, None, None, None, "order.placed", 1, "{}", "{}", 0, datetime.now(UTC)
    )


def test_a_publish_the_broker_refused_is_not_marked_sent(amqp_engine, fast_settings, consumers):
    api = management(fast_settings)
    runtime = build_runtime(fast_settings, consumers, set_global_broker=False)
    policy = f"{fast_settings.redis_namespace}-full"
    path = f"/api/policies/%2F/{policy}"
    queues = {s.consumer: s.queue for s in consumers.all()}
    audit, billing = queues["audit"], queues["billing"]
    ns = fast_settings.redis_namespace
    try:
        runtime.broker.declare_queue(audit, ensure=True)
        runtime.broker.declare_queue(billing, ensure=True)
        body = {
            "pattern": "^" + re.escape(physical_name(ns, audit)) + "$",
            "definition": {"max-length": 0, "overflow": "reject-publish"},
            "apply-to": "queues",
            "priority": 10,
        }
        api_put(api, path, body)
        time.sleep(1)  # policies apply asynchronously
        # A quorum queue takes the message that reaches its limit and refuses the next ones.
        connection, channel = amqp_channel(fast_settings)
        try:
            channel.confirm_delivery()  # type: ignore[attr-defined]
            channel.basic_publish(  # type: ignore[attr-defined]
                exchange="",
                routing_key=physical_name(ns, audit),
                body=b"filler",
            )
        finally:
            connection.close()
        produce(amqp_engine, [NewEvent("order.placed", {"order_id": f"r-{i}"}) for i in range(5)])
        drainer = drainer_for(runtime)
        with pytest.raises(PublisherUnavailable, match="refused"):
            drainer.run_batch()
        with amqp_engine.connect() as conn:
            statuses = Counter(
                r[0] for r in conn.execute(text("SELECT status FROM pipeline.outbox"))
            )
        assert statuses == Counter({"pending": 5}), statuses
        assert scalar(amqp_engine, "SELECT count(*) FROM pipeline.inbox") == 0
        delivered = "SELECT count(*) FROM pipeline.outbox WHERE consumers IS NOT NULL"
        assert scalar(amqp_engine, delivered) == 0
        assert scalar(amqp_engine, "SELECT count(*) FROM pipeline.attempts") == 0
        api_delete(api, path)
        time.sleep(1)
        wait_until(lambda: _drain_once(drainer), timeout=30)
        assert (
            scalar(amqp_engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'") == 5
        )
        depths = runtime.transport.queue_depths([audit, billing])
        # the filler and the delivery; billing's delivery may be there twice: the refused
        # batch was offered again whole, and the inbox absorbs the duplicate
        assert depths[audit].ready == 2 and depths[billing].ready in (1, 2), depths
    finally:
        api_delete(api, path)
        runtime.close()


def _drain_once(drainer) -> bool:
    try:
        return drainer.run_batch().claimed > 0
    except PublisherUnavailable:
        return False


def api_put(api: Management, path: str, body: dict[str, object]) -> None:
    import urllib.request

    request = urllib.request.Request(
        api.base + path,
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Authorization": api.auth, "content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5):
        pass


def api_delete(api: Management, path: str) -> None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        api.base + path, method="DELETE", headers={"Authorization": api.auth}
    )
    try:
        with urllib.request.urlopen(request, timeout=5):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise


def test_retries_and_delays_go_through_quorum_delay_queues(amqp_engine, fast_settings, monkeypatch):
    """Handlers failing half the time are retried with delays (the delay queues) until each
    stage of a three-stage workflow took effect once per order."""
    monkeypatch.setattr(f"{APP}.FAIL_RATE", 0.5)
    orders = [f"d-{i}" for i in range(30)]
    with running_pipeline(fast_settings, APP, threads=4):
        produce(
            amqp_engine,
            [NewEvent("order.placed", {"order_id": o}, aggregate_id=o) for o in orders],
        )
        wait_until(
            lambda: (
                scalar(amqp_engine, "SELECT count(*) FROM effects WHERE stage = 'notifications'")
                == 30
            ),
            timeout=120,
            progress=lambda: scalar(amqp_engine, "SELECT count(*) FROM pipeline.attempts"),
        )
    with amqp_engine.connect() as conn:
        done = Counter(
            (r[0], r[1]) for r in conn.execute(text("SELECT stage, order_id FROM effects"))
        )
    stages = ("payments", "inventory", "notifications")
    assert done == Counter({(s, o): 1 for s in stages for o in orders})
    retried = scalar(amqp_engine, "SELECT count(*) FROM pipeline.attempts")
    assert isinstance(retried, int) and retried > 0, "the failure injection never fired"
    assert scalar(amqp_engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert_quorum(fast_settings, delay_queue_name("pipeline.ledger"))


def management_call(client: Management, method: str, path: str, body: object = None) -> Any:
    """One call of the management API, as an operator's tool would make it."""
    request = urllib.request.Request(
        client.base + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": client.auth, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        answer = response.read()
    return json.loads(answer) if answer else None


def test_a_parked_retry_that_cannot_be_published_again_is_kept_and_tried_again(
    amqp_settings, caplog
):
    """A retry due later than the worker may hold a delivery is parked, then published to
    the delay queue again, on the consumer thread's publishing connection. While RabbitMQ
    refuses that connection (closed, and the virtual host at its connection limit), the
    worker keeps the retry and tries again every second; once it connects, the retry runs
    once, on time. (Given up after one failure, the delivery would wait unacknowledged for
    its channel to close, which a healthy consumer's never does.)"""
    from tests.apps.long_backoff_app import RETRY_BACKOFF  # not at collection: conftest.py

    if os.environ.get("PIPELINE_TEST_AMQP_URL"):
        pytest.skip("limits the virtual host's connections: only on a node of the tests' own")
    client = management(amqp_settings)  # skips without the management API
    # held at most 7 s: the 8 s retry is parked, and published again 7 s after it came
    settings = amqp_settings.replace(
        broker_consumer_timeout_ms=14_000, lease_seconds=3.0, poll_interval_max=0.5
    )
    configure(settings)
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="pipeline.transport.broker")  # parking
    vhost = quote(client.vhost, safe="")
    limit = f"/api/vhost-limits/{vhost}/max-connections"
    queues = {
        physical_name(settings.redis_namespace, q)
        for q in ("pipeline.patient", "pipeline.patient.DQ")
    }

    def said(text: str) -> bool:
        return any(text in r.getMessage() for r in caplog.records)

    def refusals() -> list[str]:
        return [m for r in caplog.records if "could not hold" in (m := r.getMessage())]

    def consuming() -> set[str]:
        """The connections consuming this test's queues (one per consumer thread)."""
        listed = management_call(client, "GET", f"/api/consumers/{vhost}")
        return {
            c["channel_details"]["connection_name"]
            for c in listed
            if c["queue"]["name"] in queues and isinstance(c.get("channel_details"), dict)
        }  # details come with the node's next statistics (an empty list until then)

    with (
        engine_with_tables(settings, TABLES, pool_size=2) as engine,
        running_pipeline(settings, "tests.apps.long_backoff_app", threads=2),
    ):
        consumers = wait_until(
            lambda: (found := consuming()) and len(found) == 2 and found, timeout=60
        )
        produce(engine, [NewEvent("parcel.shipped", {"order_id": "p-1"}, aggregate_id="p-1")])
        wait_until(lambda: said("handler failed; will retry"), timeout=60)
        failed_at = time.monotonic()
        wait_until(lambda: said("holding a delayed message"), timeout=30)  # the retry, parked
        listed = management_call(client, "GET", f"/api/vhosts/{vhost}/connections?columns=name")
        others = [c["name"] for c in listed if c["name"] not in consumers]
        management_call(client, "PUT", limit, {"value": len(listed) - len(others)})
        try:
            for name in others:  # the publishing connections, the retry's among them
                management_call(client, "DELETE", f"/api/connections/{quote(name, safe='')}")
            with pytest.raises(pika.exceptions.AMQPConnectionError):  # the limit holds
                amqp_channel(settings)
            wait_until(lambda: len(refusals()) >= 2, timeout=30)  # refused, kept, refused
        finally:
            management_call(client, "DELETE", limit)
        wait_until(lambda: scalar(engine, PROCESSED) == 1, timeout=RETRY_BACKOFF + 30)
        ran_after = time.monotonic() - failed_at
        time.sleep(2)  # a stray copy would run meanwhile
        transport = AmqpTransport(settings)
        try:
            depths = transport.queue_depths(["pipeline.patient"])
        finally:
            transport.close()
    assert all(line.endswith("trying again") for line in refusals())
    assert ran_after >= RETRY_BACKOFF - 1  # not before it was due
    assert scalar(engine, "SELECT count(*) FROM effects") == 1
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert depths == {"pipeline.patient": QueueDepth(0, 0, 0)}


def test_an_actor_message_sent_with_a_delay_arrives_after_it(amqp_settings):
    seen: list[float] = []
    registry = Registry()
    runtime = build_runtime(amqp_settings, registry, set_global_broker=False)
    import dramatiq

    def record(sent: float) -> None:
        seen.append(time.time() - sent)

    actor = dramatiq.Actor(
        record,
        broker=runtime.broker,
        actor_name="t_delayed",
        queue_name="t.delayed",
        priority=0,
        options={},
    )
    try:
        with running_worker(runtime, threads=2):
            actor.send_with_options(args=(time.time(),), delay=1500)
            wait_until(lambda: len(seen) == 1, timeout=30)
        assert seen[0] >= 1.5
        assert_quorum(amqp_settings, delay_queue_name("t.delayed"))
    finally:
        runtime.close()


def test_garbage_and_foreign_messages_on_a_queue_are_dead_lettered(amqp_engine, fast_settings):
    runtime = build_runtime(fast_settings, app_registry(APP), set_global_broker=False)
    queue = physical_name(fast_settings.redis_namespace, "pipeline.ledger")
    runtime.broker.declare_queue("pipeline.ledger", ensure=True)
    connection, channel = amqp_channel(fast_settings)
    ghost = {
        "queue_name": "pipeline.ledger",
        "actor_name": "pipeline_inbox_ghost",
        "args": [[]],
        "kwargs": {},
        "options": {},
        "message_id": str(uuid.uuid4()),
        "message_timestamp": int(time.time() * 1000),
    }
    try:
        for body in (b"\xff\xfenot json at all", b'{"foreign": true}', json.dumps(ghost).encode()):
            channel.basic_publish(exchange="", routing_key=queue, body=body)  # type: ignore[attr-defined]
    finally:
        connection.close()
    try:
        with running_worker(runtime, threads=2) as worker:
            wait_until(
                lambda: scalar(amqp_engine, "SELECT count(*) FROM pipeline.dead_letters") == 3, 30
            )
            produce(amqp_engine, [NewEvent("entry.booked", {"order_id": "after-garbage"})])
            drainer = drainer_for(runtime)
            while drainer.run_batch().claimed:
                pass
            wait_until(lambda: scalar(amqp_engine, "SELECT count(*) FROM effects") == 1, 30)
            threads = [*worker.consumers.values(), *worker.workers]
            assert all(thread.is_alive() for thread in threads)
        depths = runtime.transport.queue_depths(["pipeline.ledger"])
        assert depths["pipeline.ledger"].ready == 0
    finally:
        runtime.close()
    with amqp_engine.connect() as conn:
        rows = conn.execute(
            text("SELECT stage, reason, raw_message FROM pipeline.dead_letters ORDER BY id")
        ).all()
    reasons = [r[1] for r in rows]
    assert sum(r.startswith("undecodable message") for r in reasons) == 2, reasons
    assert any("pipeline_inbox_ghost" in r and "unknown consumer" in r for r in reasons), reasons
    assert any(r[2] is not None and "not json at all" in r[2] for r in rows)


def test_queue_depths_and_namespace_clean_up(amqp_settings):
    transport = open_transport(amqp_settings, middleware=[])
    try:
        transport.broker.declare_queue("t.depth", ensure=True)
        connection, channel = amqp_channel(amqp_settings)
        try:
            for _ in range(3):
                channel.basic_publish(  # type: ignore[attr-defined]
                    exchange="",
                    routing_key=physical_name(amqp_settings.redis_namespace, "t.depth"),
                    body=b"x",
                )
        finally:
            connection.close()
        wait_until(lambda: transport.queue_depths(["t.depth"])["t.depth"].ready == 3, 10)
        assert transport.queue_depths(["never.declared"])["never.declared"].ready == 0
        try:
            management_api = Management.for_settings(amqp_settings)
            management_api.nodes()
        except ServiceUnavailableError:
            return
        # the management API refreshes its message counts every few seconds
        wait_until(lambda: "t.depth" in transport.queues_holding_messages(), timeout=30)
        management_url = amqp_settings.broker_management_url
        type(transport).delete_namespace(
            amqp_settings.require_broker_url(),
            amqp_settings.redis_namespace,
            management_url.get_secret_value() if management_url else None,
        )
        left = [
            q["name"]
            for q in management_api.queues()
            if q["name"].startswith(f"{amqp_settings.redis_namespace}.")
        ]
        assert left == []
    finally:
        transport.close()


def test_readiness_names_an_unreachable_broker_in_one_line():
    from pipeline.readiness import transport_problem

    settings = Settings(broker_url="amqp://guest:secret@127.0.0.1:1/")  # type: ignore[arg-type]
    problem = transport_problem(settings)
    assert problem is not None and problem.startswith("cannot use RabbitMQ at amqp://guest:***@")
    assert "secret" not in problem and "\n" not in problem


def test_relay_and_worker_processes_on_rabbitmq_pass_the_doctor(amqp_settings, tmp_path):
    """`pipeline relay` and `pipeline worker` as processes on RabbitMQ carry the canary, and
    `pipeline doctor` finds the deployment healthy, its queues quorum queues."""
    from tests.integration.test_doctor import doctor_cli, problems
    from tests.support import start_relay, start_worker, stop_process

    app = "tests.apps.relay_app"
    settings = amqp_settings.replace(canary_interval=1.0)
    relay = start_relay(settings, app, tmp_path / "relay.log", "--mode", "inline")
    worker = start_worker(settings, app, tmp_path / "worker.log", processes=1, threads=2)
    engine = create_engine(settings.sqlalchemy_url())
    arrived = (
        "SELECT count(*) FROM pipeline.inbox WHERE consumer = 'pipeline_canary' "
        "AND status = 'processed'"
    )
    try:
        wait_until(lambda: bool(scalar(engine, arrived)), timeout=90, interval=0.3)
        code, report, _ = doctor_cli(settings)
    finally:
        stop_process(worker)
        stop_process(relay)
        engine.dispose()
    assert problems(report) == {}, report
    assert code == 0
    statuses = {f["check"]: f["status"] for f in report["findings"]}
    for check in ("rabbitmq", "rabbitmq_confirms", "rabbitmq_consumer_timeout", "lease"):
        assert statuses[check] == "ok", (check, report)
    if statuses["rabbitmq_queues"] != "info":  # info: no management API to list them
        assert statuses["rabbitmq_queues"] == "ok"
        assert statuses["rabbitmq_cluster"] == "ok"
    assert "redis" not in statuses


def test_doctor_names_classic_queues_and_a_short_consumer_timeout(amqp_settings):
    from pipeline.tools.ops.doctor import run_doctor

    management(amqp_settings)  # skips without the management API
    transport = open_transport(amqp_settings, middleware=[])
    try:
        transport.broker.declare_queue("t.quorum", ensure=True)
    finally:
        transport.close()
    classic = physical_name(amqp_settings.redis_namespace, "t.classic")
    connection, channel = amqp_channel(amqp_settings)
    try:
        channel.queue_declare(queue=classic, durable=True)  # type: ignore[attr-defined]
    finally:
        connection.close()
    settings = amqp_settings.replace(broker_consumer_timeout_ms=1000)
    report = run_doctor(settings, [])
    found = {f.check: f for f in report.findings}
    assert found["rabbitmq_queues"].status == "problem"
    assert classic in found["rabbitmq_queues"].summary
    assert "t.quorum" not in found["rabbitmq_queues"].summary
    assert found["rabbitmq_consumer_timeout"].status == "problem"
    assert "30000 ms" in found["rabbitmq_consumer_timeout"].summary  # the relay's lease
    assert found["rabbitmq_cluster"].status == "ok"
    assert not report.healthy


def test_status_with_rabbitmq_down_is_one_line_without_the_password(amqp_settings):
    from pipeline.tools.harness.server import free_port

    port = free_port()
    env = pipeline_env(amqp_settings, APP)
    env.pop("PIPELINE_REDIS_URL", None)
    env["PIPELINE_BROKER_URL"] = f"amqp://guest:pw123@127.0.0.1:{port}/%2F"
    result = run_cli(["status"], env)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pipeline: error: cannot use RabbitMQ at amqp://guest:***@127.0.0.1")
    assert "pw123" not in line


def test_signed_envelopes_flow_on_rabbitmq(amqp_engine, fast_settings):
    """With a message key the RabbitMQ publisher signs each envelope, and workers accept them."""
    settings = fast_settings.replace(message_key="k" * 40)
    configure(settings)
    with running_pipeline(settings, APP, threads=2):
        produce(amqp_engine, [NewEvent("entry.booked", {"order_id": f"s-{i}"}) for i in range(5)])
        wait_until(lambda: scalar(amqp_engine, "SELECT count(*) FROM effects") == 5, timeout=60)
    assert scalar(amqp_engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    runtime = build_runtime(settings, Registry(), set_global_broker=False)
    try:
        assert runtime.publisher.signer.signing  # type: ignore[attr-defined]
    finally:
        runtime.close()


GARBAGE_QUEUE, GARBAGE_ACTOR = "pipeline.ledger", "pipeline_inbox_ledger"


def test_on_rabbitmq_a_message_delivered_twice_is_dead_lettered_once(
    amqp_engine, fast_settings: Settings, tmp_path
):
    """The same bodies published twice on a RabbitMQ queue (what a redelivery after a
    worker died looks like there): arguments that do not fit, an undecodable envelope, an
    unknown actor. A real worker records each once."""
    bodies = [
        json.dumps(
            {
                "queue_name": GARBAGE_QUEUE,
                "actor_name": actor,
                "args": args,
                "kwargs": {},
                "options": {},
                "message_id": str(uuid.uuid4()),
                "message_timestamp": 0,
            }
        ).encode()
        for actor, args in [
            (GARBAGE_ACTOR, []),
            (GARBAGE_ACTOR, [[{"specversion": "1.0", "id": "x"}]]),
            ("pipeline_inbox_ghost", [[]]),
        ]
    ]
    runtime = build_runtime(fast_settings, app_registry(APP), set_global_broker=False)
    try:
        runtime.broker.declare_queue(GARBAGE_QUEUE, ensure=True)
        connection, channel = amqp_channel(fast_settings)
        try:
            for body in bodies * 2:
                channel.basic_publish(  # type: ignore[attr-defined]
                    exchange="",
                    routing_key=physical_name(fast_settings.redis_namespace, GARBAGE_QUEUE),
                    body=body,
                )
        finally:
            connection.close()
        log = tmp_path / "worker.log"
        worker = start_worker(fast_settings, APP, log, processes=1, threads=2)
        try:
            wait_until(lambda: len(dead_letters(amqp_engine)) >= 3, timeout=60, alive=[worker])
            produce(amqp_engine, [NewEvent("entry.booked", {"order_id": "after"})])
            drainer = drainer_for(runtime)
            while drainer.run_batch().claimed:  # behind the six: all were handled once it is
                pass
            wait_until(
                lambda: scalar(amqp_engine, "SELECT count(*) FROM effects") == 1,
                timeout=60,
                alive=[worker],
            )
        finally:
            stop_process(worker)
    finally:
        runtime.close()
    letters = dead_letters(amqp_engine)
    assert len(letters) == 3, letters
    assert log.read_text().count("dead-lettered already") == 3, log.read_text()[-3000:]


def test_the_demo_on_rabbitmq_holds_its_invariants_and_leaves_no_queue(amqp_settings):
    """``pipeline demo`` given an AMQP URL (and this test's database) runs its relay and
    workers on RabbitMQ: every invariant of its summary holds, the injected duplicates are
    absorbed, and its own quorum queues are gone afterwards."""
    import subprocess

    from tests.integration.test_demo import DEMO_TIMEOUT, clean_env, demo_command

    api = management(amqp_settings)
    env = clean_env()
    env.update(
        PIPELINE_BROKER_URL=amqp_settings.require_broker_url(),
        PIPELINE_DATABASE_URL=amqp_settings.require_database_url(),
    )
    if amqp_settings.broker_management_url is not None:
        env["PIPELINE_BROKER_MANAGEMENT_URL"] = (
            amqp_settings.broker_management_url.get_secret_value()
        )
    done = subprocess.run(
        demo_command("--events", "30", "--duplicates", "0.5", "--processes", "1", "--json"),
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["ok"] is True, summary["failed_invariants"]
    assert "PIPELINE_BROKER_URL amqp://" in summary["setup"]["redis"]
    assert summary["processed"] == {"payments": 30, "inventory": 30, "notifications": 30}
    assert summary["charges"]["made"] == summary["charges"]["orders"] == 30
    assert summary["events"]["published"] == 91 and summary["events"]["unsent"] == 0
    duplicates = summary["duplicates"]
    assert duplicates["absorbed_total"] >= duplicates["injected_total"] > 0
    assert "could not" not in done.stderr, done.stderr[-2000:]  # every clean-up step done
    left = [q["name"] for q in api.queues() if str(q["name"]).startswith("pipeline_demo_")]
    assert left == []
