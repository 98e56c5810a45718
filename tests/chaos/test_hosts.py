"""The pipeline across hosts: Postgres, Redis, the relay, the workers and the producer each
on a host of its own (a network namespace), and partitions between them while it runs.

Partitions here are silent, as between machines: packets vanish, nobody gets a reset, and
only timeouts and keepalives end a connection. Needs root (namespaces); skipped otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from pipeline import NewEvent, Settings, configure
from pipeline.db.migrate import upgrade
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
