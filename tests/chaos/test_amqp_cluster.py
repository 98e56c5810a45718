"""A three-node RabbitMQ cluster loses a node while events are produced and consumed.

The cluster is the project's own (:class:`RabbitCluster`: Debian's rabbitmq-server, three
nodes on this machine); the test skips with one line where rabbitmq-server is not
installed. The node killed (SIGKILL) is the leader of the consumer's quorum queue, so a
new leader must be elected while the relay publishes with confirms and the worker
consumes. Afterwards every event took effect exactly once: none lost, none doubled.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from pipeline import NewEvent, Settings, configure
from pipeline.tools.harness import server
from pipeline.tools.harness.rabbitmq_cluster import RabbitCluster
from pipeline.transport.amqp.broker import physical_name
from pipeline.transport.amqp.management import Management
from tests.integration.test_inbox import TABLES
from tests.support import SOAK, produce, rabbitmq_nodes, running_pipeline, soak, wait_until

APP = "tests.apps.inbox_app"


@pytest.fixture
def cluster() -> Iterator[RabbitCluster]:
    if not SOAK:  # each test starts three nodes (30-50 s) and runs minutes under load
        pytest.skip("three-node RabbitMQ cluster tests run with PIPELINE_SOAK=1")
    with rabbitmq_nodes(3) as value:
        yield value


def leader_of(cluster: RabbitCluster, settings: Settings, queue: str) -> int:
    """The index (1-based) of the node leading ``queue``, as a running node's API says."""
    name = physical_name(settings.redis_namespace, queue)
    for node in cluster.nodes:
        if not node.running:
            continue
        for listed in Management(node.url, node.management_url).queues():
            if listed["name"] == name and listed.get("leader"):
                return next(n.index for n in cluster.nodes if n.name == listed["leader"])
    raise AssertionError(f"no leader known for {name}")


def test_killing_the_leader_node_while_producing_and_consuming_loses_nothing(
    cluster: RabbitCluster, database_url: str
):
    settings = Settings(
        database_url=database_url,  # type: ignore[arg-type]
        broker_url=cluster.url,  # type: ignore[arg-type]
        redis_namespace=f"c{uuid.uuid4().hex[:8]}",
        canary_interval=0,
        lease_seconds=3.0,
        poll_interval_max=0.5,
        broker_confirm_timeout=10.0,
    )
    configure(settings)
    engine = create_engine(settings.sqlalchemy_url(), pool_size=3)
    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)
    total = soak(600, 5000)
    batches = 30
    produced = threading.Event()

    def producer() -> None:
        per = total // batches
        for b in range(batches):
            produce(
                engine,
                [NewEvent("entry.booked", {"order_id": f"k-{b}-{i}"}) for i in range(per)],
                per_transaction=10,
            )
            time.sleep(0.5)
        produced.set()

    def effects() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM effects")).scalar_one())

    try:
        with running_pipeline(settings, APP, threads=4):
            thread = threading.Thread(target=producer, daemon=True)
            thread.start()
            wait_until(lambda: effects() > total // 10, timeout=120, progress=effects)
            victim = leader_of(cluster, settings, "pipeline.ledger")
            cluster.kill(victim)
            assert not produced.is_set(), "the producer finished before the fault"
            thread.join(timeout=300)
            wait_until(lambda: effects() >= total, timeout=300, progress=effects)
            time.sleep(2)  # a duplicate that would double an effect has time to arrive
        with engine.connect() as conn:
            done = Counter(r[0] for r in conn.execute(text("SELECT order_id FROM effects")))
            unsent = conn.execute(
                text("SELECT count(*) FROM pipeline.outbox WHERE status <> 'sent'")
            ).scalar_one()
            dead = conn.execute(text("SELECT count(*) FROM pipeline.dead_letters")).scalar_one()
    finally:
        configure(None)
        engine.dispose()
    expected = {f"k-{b}-{i}" for b in range(batches) for i in range(total // batches)}
    assert set(done) == expected, f"lost: {len(expected - set(done))}"
    assert all(count == 1 for count in done.values()), "an effect was doubled"
    assert unsent == 0 and dead == 0
    new_leader = leader_of(cluster, settings, "pipeline.ledger")
    assert new_leader != victim


def test_without_a_majority_nothing_is_marked_sent_until_one_returns(
    cluster: RabbitCluster, database_url: str
):
    """Two nodes of three down: the queues have no quorum, publishes go unconfirmed, the
    relay marks nothing sent; one node back and the same events go out."""
    import psycopg

    from pipeline.errors import PublisherUnavailable
    from pipeline.registry import Registry
    from pipeline.relay.drain import Drainer
    from pipeline.runtime import build_runtime

    settings = Settings(
        database_url=database_url,  # type: ignore[arg-type]
        broker_url=cluster.url_from(3),  # type: ignore[arg-type]
        redis_namespace=f"c{uuid.uuid4().hex[:8]}",
        canary_interval=0,
        broker_confirm_timeout=5.0,
    )
    routes = Registry()
    routes.subscribe("audit", ["*"])
    runtime = build_runtime(settings, routes, set_global_broker=False)
    engine = create_engine(settings.sqlalchemy_url(), pool_size=2)
    conn = psycopg.connect(settings.require_database_url(), autocommit=True)
    drainer = Drainer(settings, runtime.publisher, routes, "t", conn)

    def sent() -> int:
        with engine.connect() as c:
            return int(
                c.execute(
                    text("SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'")
                ).scalar_one()
            )

    try:
        produce(engine, [NewEvent("order.placed", {"n": i}) for i in range(5)])
        assert drainer.run_batch().claimed == 5  # declares the quorum queue on 3 members
        assert sent() == 5
        cluster.stop(1)
        cluster.stop(2)
        produce(engine, [NewEvent("order.placed", {"n": i}) for i in range(5, 10)])
        for _ in range(2):
            with pytest.raises(PublisherUnavailable):
                drainer.run_batch()
            assert sent() == 5
        cluster.restart(2)

        def drained() -> bool:
            try:
                drainer.run_batch()
            except PublisherUnavailable:
                return False
            return sent() == 10

        wait_until(drained, timeout=180)
    finally:
        conn.close()
        runtime.close()
        engine.dispose()


@pytest.fixture
def single_node() -> Iterator[RabbitCluster]:
    with rabbitmq_nodes(1) as value:
        yield value


def test_a_worker_waits_through_a_broker_outage_one_line_per_step(
    single_node: RabbitCluster, database_url: str, tmp_path
):
    """RabbitMQ killed under a running `pipeline worker` and relay: the worker logs one line
    per backoff step (no tracebacks, no per-thread errors) and consumes again once the node
    is back; events produced during the outage take effect once."""
    from tests.support import start_relay, start_worker, stop_process

    settings = Settings(
        database_url=database_url,  # type: ignore[arg-type]
        broker_url=single_node.url,  # type: ignore[arg-type]
        redis_namespace=f"c{uuid.uuid4().hex[:8]}",
        canary_interval=0,
    )
    engine = create_engine(settings.sqlalchemy_url(), pool_size=2)
    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)
    worker_log = tmp_path / "worker.log"
    worker = start_worker(settings, APP, worker_log, processes=1, threads=2)
    relay = start_relay(settings, APP, tmp_path / "relay.log", "--mode", "inline")

    def effects() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM effects")).scalar_one())

    try:
        produce(engine, [NewEvent("entry.booked", {"order_id": "before"})])
        wait_until(lambda: effects() == 1, timeout=60)
        single_node.kill(1)
        produce(engine, [NewEvent("entry.booked", {"order_id": f"during-{i}"}) for i in range(5)])
        wait_until(
            lambda: worker_log.read_text(errors="replace").count("RabbitMQ unreachable") >= 3,
            timeout=60,
        )
        single_node.restart(1)
        wait_until(lambda: effects() == 6, timeout=120, progress=effects)
        assert worker.poll() is None
    finally:
        stop_process(worker)
        stop_process(relay)
        engine.dispose()
    text_ = worker_log.read_text(errors="replace")
    steps = [line for line in text_.splitlines() if "RabbitMQ unreachable" in line]
    assert all("next try in" in line for line in steps)
    assert "RabbitMQ reachable again: consuming" in text_
    assert "Traceback" not in text_ and "CRITICAL" not in text_, text_[-3000:]
    relay_text = (tmp_path / "relay.log").read_text(errors="replace")
    waits = [line for line in relay_text.splitlines() if "relay waiting" in line]
    assert waits, relay_text[-3000:]  # the events produced during the outage were owed
    assert all("RabbitMQ" in line and "next try in" in line for line in waits), waits
    assert "Traceback" not in relay_text, relay_text[-3000:]


def test_a_node_whose_picked_port_was_taken_meanwhile_boots_on_other_ports(monkeypatch):
    """A port picked free is taken by another process before the node binds it (a client's
    outgoing connection on a busy machine took the distribution port once): the node exits
    at once, and boots again on other ports."""
    from pipeline.tools.harness import rabbitmq_cluster

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    picks = [rabbitmq_cluster.free_port(), taken]  # the AMQP port, then the distribution port
    monkeypatch.setattr(
        rabbitmq_cluster,
        "free_port",
        lambda: picks.pop(0) if picks else server.free_port(),
    )
    try:
        with rabbitmq_nodes(1) as value:
            [node] = value.nodes
            assert node.dist_port != taken
            assert Management(node.url, node.management_url).nodes()[0]["running"]
            first_boot = (node.directory / "node.1.log").read_text()
            assert "dist_port_already_used" in first_boot
    finally:
        holder.close()
