"""Test tiers and the real-server fixtures they share.

Every test is marked with its tier from its directory: ``unit`` (tests/unit: no
servers, seconds), ``integration`` (tests/integration: real Postgres and Redis) and
``chaos`` (tests/chaos: real relay and worker processes, crashes); ``pytest -m unit``
runs the first alone. A unit test that asks for a server fixture fails at set-up, so
the unit tier cannot start a server by accident.

Postgres, Redis and RabbitMQ come from ``PIPELINE_TEST_DATABASE_URL`` /
``PIPELINE_TEST_REDIS_URL`` / ``PIPELINE_TEST_AMQP_URL`` when set, else from throwaway
servers started the first time a test needs them (session fixtures are lazy: a run of
unit tests starts none; the RabbitMQ tests skip in one line without ``rabbitmq-server``).
Each test gets its own database cloned from a migrated template and its own Redis key
namespace, so a shared server's other data is never touched.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Engine, create_engine

from pipeline.config import Settings, configure, libpq_url
from pipeline.db.migrate import upgrade
from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis
from pipeline.transport.namespace import delete_namespace
from tests.support import OtlpReceiver, global_registry_kept, rabbitmq_nodes

RUN_ID = uuid.uuid4().hex[:8]
TIERS = ("unit", "integration", "chaos")
SERVER_FIXTURES = frozenset(
    {
        "postgres_server_url",
        "redis_server_url",
        "amqp_server",
        "private_postgres",
        "private_redis",
    }
)


# The modules that take longest, longest first (seconds of one run of the default suite on
# 2 cores). xdist hands modules out whole (--dist loadscope) in collection order
# (--no-loadscope-reorder), so these start first and the many short ones fill the gaps at
# the end, instead of a long module starting last and running alone.
LONGEST_FIRST = (
    "integration/test_ops_kit.py",  # 150
    "chaos/test_drill.py",  # 75
    "chaos/test_stuck_workers.py",  # 52
    "chaos/test_drill_amqp.py",  # 47
    "chaos/test_drill_hosts.py",  # 46
    "integration/test_amqp_consumer_timeout.py",  # 40: two 8 s retries on a node of its own
    "integration/test_demo.py",  # 37
    "chaos/test_outages.py",  # 36
    "integration/test_dlq.py",  # 32
    "integration/test_dead_letter_once.py",
    "integration/test_inbox.py",  # 31
    "integration/test_queue_garbage.py",  # 31
    "chaos/test_broker_losses.py",  # 30
    "integration/test_amqp_transport.py",  # 28
    "integration/test_observability.py",  # 28
    "integration/test_doctor.py",  # 27
    "integration/test_state_refresh.py",  # 25
    "chaos/test_relay_processes.py",  # 26
    "integration/test_missing_bodies.py",  # 25
)


def pytest_configure(config: pytest.Config) -> None:
    """Compile the package and the test apps once where the environment forbids writing
    bytecode (``PYTHONDONTWRITEBYTECODE``, ``-B``): an editable install leaves them
    uncompiled, so each of the hundreds of relay, worker and CLI processes the tests start
    would compile them from source again (a tenth of a second of CPU each). The bytecode
    goes where Python puts it, ``__pycache__`` (ignored by git)."""
    if hasattr(config, "workerinput") or not sys.flags.dont_write_bytecode:
        return  # an xdist worker (its controller compiled), or Python writes it as it goes
    import compileall

    root = Path(__file__).resolve().parent.parent
    for directory in (root / "pipeline", root / "tests" / "apps"):
        compileall.compile_dir(directory, quiet=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier its directory names (tests/<tier>/...); longest first."""
    root = Path(__file__).parent
    rank = {str(root / name): n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))
    for item in items:
        try:
            tier = item.path.relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A unit test must not start or use a server, directly or through another fixture."""
    if item.get_closest_marker("unit") is None:
        return
    wanted = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if wanted:
        pytest.fail(
            f"unit tests use no servers, but this one asks for {sorted(wanted)}: "
            "move it to tests/integration",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def registry_left_as_found() -> Iterator[None]:
    """No test's consumers outlive it in the process-wide registry (tests share a process)."""
    with global_registry_kept():
        yield


def pytest_collection_finish(session: pytest.Session) -> None:
    """No test app may be imported while tests are collected: its consumers would sit in
    the process-wide registry for the whole run, before any test could put it back as it
    found it (:func:`registry_left_as_found`), and refuse or shadow another app's consumer
    of the same name in whichever later test shares the process."""
    imported = sorted(name for name in sys.modules if name.startswith("tests.apps."))
    if imported:
        raise pytest.UsageError(
            f"test apps imported at collection: {', '.join(imported)}; import them inside "
            "the tests that use them (or name them in PIPELINE_APP_MODULES)"
        )


@pytest.fixture(scope="session", autouse=True)
def initdb_once() -> Iterator[None]:
    """Every Postgres this process starts copies one initdb'd cluster (seconds saved each)."""
    cache = Path(tempfile.mkdtemp(prefix="pipeline-initdb-"))
    cache.chmod(0o711)  # a server run as another user (when root) must reach its template
    EmbeddedPostgres.initdb_cache = cache
    try:
        yield
    finally:
        EmbeddedPostgres.initdb_cache = None
        shutil.rmtree(cache, ignore_errors=True)


Server = TypeVar("Server", EmbeddedPostgres, EmbeddedRedis)


@contextmanager
def _started(server: Server) -> Iterator[Server]:
    """``server`` started, and removed with its data when the block ends."""
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def _replace_dbname(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{dbname}"))


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    given = os.environ.get("PIPELINE_TEST_DATABASE_URL")
    if given:
        yield libpq_url(given)
        return
    with _started(EmbeddedPostgres(durable=False)) as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    given = os.environ.get("PIPELINE_TEST_REDIS_URL")
    if given:
        yield given
        return
    with _started(EmbeddedRedis()) as server:
        yield server.url


def _admin(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(url, autocommit=True)


@pytest.fixture(scope="session")
def template_database(postgres_server_url: str) -> Iterator[str]:
    """A database migrated once per session; every test clones it."""
    name = f"pipeline_tpl_{RUN_ID}"
    with _admin(postgres_server_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = _replace_dbname(postgres_server_url, name)
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(url))
    with engine.begin() as connection:
        upgrade(connection, "pipeline")
    engine.dispose()
    try:
        yield name
    finally:
        with _admin(postgres_server_url) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def create_database(server_url: str, template: str | None = None) -> tuple[str, str]:
    """Create a uniquely named database; returns (name, url)."""
    name = f"pipeline_t_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    with _admin(server_url) as conn:
        conn.execute(query)
    return name, _replace_dbname(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    with _admin(server_url) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def database_url(postgres_server_url: str, template_database: str) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    name, url = create_database(postgres_server_url, template_database)
    try:
        yield url
    finally:
        drop_database(postgres_server_url, name)


@pytest.fixture
def empty_database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh database without the pipeline schema."""
    name, url = create_database(postgres_server_url)
    try:
        yield url
    finally:
        drop_database(postgres_server_url, name)


@dataclass(frozen=True)
class AmqpServer:
    url: str
    management_url: str | None  # None: the broker's host, port 15672


@pytest.fixture(scope="session")
def amqp_server() -> Iterator[AmqpServer]:
    """A RabbitMQ server: ``PIPELINE_TEST_AMQP_URL`` (its management API at
    ``PIPELINE_TEST_AMQP_MANAGEMENT_URL`` if set), else a throwaway node of Debian's
    ``rabbitmq-server`` started here (own ports and data, management API on).

    The tests that need it skip, with the reason in one line, where neither is there.
    """
    given = os.environ.get("PIPELINE_TEST_AMQP_URL")
    if given:
        from pipeline.transport.amqp.transport import AmqpTransport

        problem = AmqpTransport.problem(Settings(broker_url=given))  # type: ignore[arg-type]
        if problem is not None:
            pytest.skip(f"no RabbitMQ at PIPELINE_TEST_AMQP_URL: {problem}")
        yield AmqpServer(given, os.environ.get("PIPELINE_TEST_AMQP_MANAGEMENT_URL"))
        return
    with rabbitmq_nodes(1) as node:
        [first] = node.nodes
        yield AmqpServer(first.url, first.management_url)


@pytest.fixture
def amqp_settings(database_url: str, amqp_server: AmqpServer) -> Iterator[Settings]:
    """Settings for this test's database and a queue namespace of its own on RabbitMQ,
    installed process-wide; the namespace's queues are deleted afterwards."""
    namespace = f"t{RUN_ID}{uuid.uuid4().hex[:8]}"
    value = Settings(
        database_url=database_url,  # type: ignore[arg-type]
        broker_url=amqp_server.url,  # type: ignore[arg-type]
        broker_management_url=amqp_server.management_url,  # type: ignore[arg-type]
        redis_namespace=namespace,
        canary_interval=0,
    )
    configure(value)
    try:
        yield value
    finally:
        configure(None)
        delete_namespace(amqp_server.url, namespace, amqp_server.management_url)


@pytest.fixture
def redis_namespace(redis_server_url: str) -> Iterator[str]:
    """A key namespace private to this test; only its own keys are deleted afterwards."""
    namespace = f"t{RUN_ID}{uuid.uuid4().hex[:8]}"
    yield namespace
    delete_namespace(redis_server_url, namespace)


@pytest.fixture
def settings(database_url: str, redis_server_url: str, redis_namespace: str) -> Iterator[Settings]:
    """Settings for this test's database and namespace, installed process-wide."""
    value = Settings(
        database_url=database_url,  # type: ignore[arg-type]
        redis_url=redis_server_url,  # type: ignore[arg-type]
        redis_namespace=redis_namespace,
        canary_interval=0,  # tests that want the canary turn it on
    )
    configure(value)
    try:
        yield value
    finally:
        configure(None)


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    value = create_engine(settings.sqlalchemy_url(), pool_size=5)
    try:
        yield value
    finally:
        value.dispose()


@pytest.fixture
def private_postgres() -> Iterator[EmbeddedPostgres]:
    """A Postgres server of this test's own, which the test may kill and restart."""
    with _started(EmbeddedPostgres(durable=True)) as server:
        yield server


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A Redis server of this test's own, which the test may kill and restart."""
    with _started(EmbeddedRedis()) as server:
        yield server


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A local OTLP/HTTP endpoint that keeps what it receives (an OpenTelemetry collector)."""
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()
