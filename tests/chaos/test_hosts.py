"""The pipeline across hosts: Postgres, Redis, the relay, the workers and the producer each
on a host of its own (a network namespace), and partitions between them while it runs.

Partitions here are silent, as between machines: packets vanish, nobody gets a reset, and
only timeouts and keepalives end a connection. Needs root (namespaces); skipped otherwise.
The random loss that ``link-degrade`` adds where the kernel has no netem is checked here too,
on the bare link (datagrams counted, a TCP stream compared); it also needs ``nft``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from pipeline import NewEvent, Settings, configure
from pipeline.db.migrate import upgrade
from pipeline.tools.drill.network import DEGRADE, THROTTLE
from pipeline.tools.harness.hosts import HostNetwork, host_network_problem
from pipeline.tools.harness.postgres_server import EmbeddedPostgres
from pipeline.tools.harness.redis_server import EmbeddedRedis
from tests.chaos.orders import APP, stage_counts, wait_all_notified
from tests.support import (
    SOAK,
    cli_argv,
    pipeline_env,
    produce,
    start_process,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.chaos

STAGES = ("payments", "inventory", "notifications")
HOSTS = ("pg", "broker", "relay", "work", "app")


@pytest.fixture(scope="module")
def network() -> Iterator[HostNetwork]:
    problem = host_network_problem()
    if problem is not None:
        pytest.skip(problem)
    with HostNetwork(HOSTS) as net:
        yield net


@pytest.fixture
def cluster(network: HostNetwork, tmp_path: Path) -> Iterator[tuple[Settings, Engine]]:
    """Postgres and Redis on hosts of their own; the test's thread runs on the app host."""
    with (
        EmbeddedPostgres(durable=False, host=network["pg"]) as pg,
        EmbeddedRedis(host=network["broker"]) as redis,
        network["app"].entered(),
    ):
        settings = Settings(
            database_url=pg.url,  # type: ignore[arg-type]
            redis_url=redis.url,  # type: ignore[arg-type]
            redis_namespace="hosts",
            canary_interval=0,
            lease_seconds=3.0,
            poll_interval_max=0.5,
            broker_heartbeat_timeout_ms=3000,
            redelivery_horizon_seconds=3.0,
            reconcile_interval_seconds=0.5,
        )
        engine = create_engine(settings.sqlalchemy_url(), pool_size=2)
        with engine.begin() as conn:
            upgrade(conn, settings.schema_name)
            conn.exec_driver_sql(
                "CREATE TABLE effects (id bigserial PRIMARY KEY, stage text NOT NULL, "
                "order_id text NOT NULL, event_id uuid NOT NULL)"
            )
        configure(settings)
        try:
            yield settings, engine
        finally:
            configure(None)
            engine.dispose()
            network.heal_all()


def start_on(network: HostNetwork, host: str, settings: Settings, log: Path, *args: str):
    argv = network[host].command(cli_argv(*args))
    return start_process(argv, pipeline_env(settings, APP), log)


def effects(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM effects")).scalar_one())


def place(engine: Engine, orders: list[str]) -> None:
    produce(
        engine,
        [
            NewEvent("order.placed", {"order_id": o}, aggregate_type="order", aggregate_id=o)
            for o in orders
        ],
        per_transaction=5,
    )


SOAK_ONLY = pytest.mark.skipif(not SOAK, reason="one partition in the default run; PIPELINE_SOAK=1")


@pytest.mark.parametrize(
    "cuts",
    [
        pytest.param((("work", "broker"), ("work", "pg")), id="worker-host-dropped-off"),
        pytest.param((("work", "broker"),), id="work-broker", marks=SOAK_ONLY),
        pytest.param((("work", "pg"),), id="work-pg", marks=SOAK_ONLY),
        pytest.param((("relay", "pg"),), id="relay-pg", marks=SOAK_ONLY),
        pytest.param((("relay", "broker"),), id="relay-broker", marks=SOAK_ONLY),
    ],
)
def test_a_partition_between_hosts_heals_without_loss_or_duplicate(
    network: HostNetwork,
    cluster: tuple[Settings, Engine],
    tmp_path: Path,
    cuts: tuple[tuple[str, str], ...],
) -> None:
    """Orders flow while links are cut for five seconds mid-run; after they heal every order
    goes through every stage exactly once, and the producer, on a host that was not cut,
    never waited."""
    settings, engine = cluster
    relay = start_on(network, "relay", settings, tmp_path / "relay.log", "relay")
    workers = start_on(
        network, "work", settings, tmp_path / "worker.log", "worker", "--processes", "1"
    )
    orders = [f"order-{i}" for i in range(60)]
    try:
        place(engine, orders[:20])
        wait_until(lambda: effects(engine) > 0, timeout=60, alive=[relay, workers])
        for cut in cuts:
            network.partition(*cut)
        producer = threading.Thread(target=place, args=(engine, orders[20:]))
        producer.start()  # the producer's host is not cut: it must keep committing
        time.sleep(5.0)  # the length of the partition, not a limit on anything
        for cut in cuts:
            network.heal(*cut)
        producer.join(60)
        assert not producer.is_alive(), "the producer waited on a partition it is not part of"
        wait_all_notified(engine, orders, [relay, workers], timeout=90)
        time.sleep(1.0)  # a late duplicate would show now
    finally:
        stop_process(workers)
        stop_process(relay)
    for stage in STAGES:
        counts = stage_counts(engine, stage)
        assert set(counts) == set(orders), f"{stage}: missing {set(orders) - set(counts)}"
        assert max(counts.values()) == 1, f"{stage}: duplicate effects"


SO_RCVBUFFORCE = 33  # Linux: a receive buffer past rmem_max, for root
NEEDS_NFT = pytest.mark.skipif(shutil.which("nft") is None, reason="random loss needs nft")


def datagrams_through(network: HostNetwork, sender: str, receiver: str, count: int) -> int:
    """How many of ``count`` numbered UDP datagrams sent from ``sender`` reach ``receiver``.

    The receive buffer holds all of them and the sends are paced, so that nothing but the
    link drops any: what is missing was lost on the way.
    """
    with network[receiver].entered():
        inbox = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with network[sender].entered():
        outbox = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with inbox, outbox:
        inbox.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        inbox.bind((network[receiver].address, 0))
        for number in range(count):
            outbox.sendto(number.to_bytes(4, "big") * 25, inbox.getsockname())
            if number % 20 == 19:
                time.sleep(0.001)
        inbox.settimeout(1.0)  # the link delays nothing here: a second of quiet is the end
        seen: set[int] = set()
        with contextlib.suppress(TimeoutError):
            while True:
                seen.add(int.from_bytes(inbox.recv(200)[:4], "big"))
    return len(seen)


@NEEDS_NFT
def test_random_loss_drops_a_share_each_way_and_restore_ends_it(network: HostNetwork) -> None:
    """With ``link-degrade``'s loss on the work host's link, datagrams go missing both ways,
    a share near the one asked; after :meth:`HostNetwork.restore` none do."""
    count, loss = 2000, DEGRADE[2]
    for sender, receiver in (("work", "app"), ("app", "work")):  # addresses resolved first
        assert datagrams_through(network, sender, receiver, 10) == 10
    try:
        network.lose("work", loss)
        sent_lost = count - datagrams_through(network, "work", "app", count)
        received_lost = count - datagrams_through(network, "app", "work", count)
        counted = network.lost("work")
    finally:
        network.restore("work")
    for lost in (sent_lost, received_lost):  # 5 % of 2000 is 100; 0 or 600 would be a fault
        assert 0 < lost < 0.3 * count, (sent_lost, received_lost)
    assert counted >= sent_lost + received_lost  # nft's own count (ARP too, if any was hit)
    assert network.lost("work") == 0  # its tables are gone
    assert datagrams_through(network, "work", "app", count) == count
    assert datagrams_through(network, "app", "work", count) == count


@NEEDS_NFT
@pytest.mark.timeout(120)
def test_tcp_delivers_every_byte_through_the_degraded_link(network: HostNetwork) -> None:
    """Under what ``link-degrade`` does without netem (the token bucket and random loss both
    ways), a TCP stream from the work host still arrives whole: loss is on the wire, and
    retransmission repairs it."""
    payload = os.urandom(48 * 1024)  # about 3 s at the bucket's 128 kbit/s
    with network["app"].entered():
        listener = socket.create_server((network["app"].address, 0))
    listener.settimeout(60)
    received = bytearray()

    def accept() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(60)
            while chunk := connection.recv(65536):
                received.extend(chunk)

    try:
        network.throttle("work", *THROTTLE)
        network.lose("work", DEGRADE[2])
        reader = threading.Thread(target=accept)
        reader.start()
        with network["work"].entered():
            client = socket.create_connection(listener.getsockname(), timeout=60)
        with client:
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
            reader.join(90)
        lost = network.lost("work")
    finally:
        network.restore("work")
        listener.close()
    assert not reader.is_alive(), "the stream never ended"
    assert len(received) == len(payload)
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
    assert lost > 0, "no packet was dropped: the stream was not tested under loss"
