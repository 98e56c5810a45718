"""Helpers shared by integration and chaos tests (real servers, real processes)."""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dramatiq
import redis
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from pipeline import NewEvent, Settings, add_events, configure
from pipeline.envelope import OutboxEvent
from pipeline.registry import CANARY_CONSUMER, Registry
from pipeline.registry import registry as global_registry
from pipeline.relay.relay import Relay
from pipeline.runtime import Runtime, build_runtime
from pipeline.tools.harness.rabbitmq_cluster import RabbitCluster
from pipeline.transport.redis.keys import messages_key, queue_key

ROOT = Path(__file__).resolve().parent.parent
SOAK = os.environ.get("PIPELINE_SOAK") == "1"


@contextmanager
def rabbitmq_nodes(
    size: int, *, config: str = "", advanced_config: str = ""
) -> Iterator[RabbitCluster]:
    """``size`` RabbitMQ nodes started for a test (Debian's rabbitmq-server), removed after,
    with ``config`` and ``advanced_config`` as :class:`RabbitCluster` takes them; the test
    skips in one line where rabbitmq-server is not installed."""
    import pytest

    from pipeline.errors import BinaryNotFoundError

    value = RabbitCluster(size, config=config, advanced_config=advanced_config)
    try:
        value.start()
    except BinaryNotFoundError as exc:
        value.cleanup()
        pytest.skip(f"no RabbitMQ: {exc} (or set PIPELINE_TEST_AMQP_URL)")
    except BaseException:
        value.cleanup()
        raise
    try:
        yield value
    finally:
        value.cleanup()


def soak(short: int, long: int) -> int:
    """A workload's size: ``short`` in the default run, ``long`` with ``PIPELINE_SOAK=1``.

    The short size still exercises the guarantee under test (retries happen, kills land
    mid-batch, keys interleave); the long one is the soak, for a release or a suspicion.
    """
    return long if SOAK else short


QUICK_FAULTS: dict[str, Any] = {
    "lease_seconds": 3.0,
    "poll_interval_max": 0.5,
    "broker_heartbeat_timeout_ms": 3000,
    "broker_maintenance_chance": 200_000,
}
"""Settings under which a dead relay or worker shows within seconds (short lease, quick
polls, short heartbeats) and Redis maintenance never runs in the middle of a test."""


@contextmanager
def engine_with_tables(settings: Settings, tables: str, pool_size: int = 5) -> Iterator[Engine]:
    """An engine on ``settings``' database with the test's ``tables`` created; disposed after."""
    value = create_engine(settings.sqlalchemy_url(), pool_size=pool_size)
    with value.begin() as conn:
        conn.exec_driver_sql(tables)
    try:
        yield value
    finally:
        value.dispose()


@contextmanager
def installed_settings(
    settings: Settings, engine: Engine, tables: str, **overrides: Any
) -> Iterator[Settings]:
    """``settings`` with ``overrides``, installed process-wide, after creating the test's
    ``tables``; the session's settings are installed again afterwards."""
    with engine.begin() as conn:
        conn.exec_driver_sql(tables)
    value = settings.replace(**overrides)
    configure(value)
    try:
        yield value
    finally:
        configure(settings)


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.02,
    *,
    progress: Callable[[], Any] | None = None,
    alive: Sequence[subprocess.Popen[bytes]] = (),
) -> Any:
    """Poll ``predicate`` until truthy and return its value; fail the test (not hang) else.

    ``timeout`` bounds the whole wait, or, when ``progress`` is given, a stall only: the
    deadline restarts whenever ``progress()`` returns a new value (a count rising, a log
    growing), so a slow but moving system on a busy machine does not fail the test while
    a stuck one still does. A process in ``alive`` that exits fails the wait at once.
    """
    deadline = time.monotonic() + timeout
    seen = progress() if progress is not None else None
    while True:
        value = predicate()
        if value:
            return value
        for process in alive:
            if process.poll() is not None:
                raise AssertionError(
                    f"process {process.args!r} exited with {process.returncode} "
                    f"while waiting for {predicate}"
                )
        if progress is not None:
            now = progress()
            if now != seen:
                seen = now
                deadline = time.monotonic() + timeout
        if time.monotonic() > deadline:
            stalled = " without progress" if progress is not None else ""
            raise AssertionError(f"condition not met within {timeout}s{stalled}: {predicate}")
        time.sleep(interval)


def log_size(*paths: Path) -> int:
    """The total size of these log files: a progress measure for :func:`wait_until`."""
    return sum(path.stat().st_size for path in paths if path.exists())


def queue_messages(settings: Settings, queue: str) -> list[dict[str, Any]]:
    """The Dramatiq messages waiting on ``queue``, in queue order, decoded."""
    if settings.broker_is_amqp:
        return amqp_queue_messages(settings, queue)
    client = redis.Redis.from_url(settings.require_redis_url())
    try:
        ids = client.lrange(queue_key(settings.redis_namespace, queue), 0, -1)
        if not ids:
            return []
        bodies = client.hmget(messages_key(settings.redis_namespace, queue), ids)
        return [json.loads(body) for body in bodies if body is not None]
    finally:
        client.close()


def amqp_queue_messages(settings: Settings, queue: str) -> list[dict[str, Any]]:
    """RabbitMQ's messages on ``queue``, taken without acknowledging them: closing the
    connection gives them back to the queue."""
    import pika

    from pipeline.transport.amqp.broker import physical_name

    connection = pika.BlockingConnection(pika.URLParameters(settings.require_broker_url()))
    try:
        channel = connection.channel()
        name = physical_name(settings.redis_namespace, queue)
        found = []
        while True:
            method, _properties, body = channel.basic_get(name, auto_ack=False)
            if method is None:
                return found
            found.append(json.loads(body))
    finally:
        connection.close()


def queue_envelopes(settings: Settings, queue: str) -> list[dict[str, Any]]:
    """Every envelope delivered to ``queue``, flattened in delivery order."""
    return [env for message in queue_messages(settings, queue) for env in message["args"][0]]


def produce(engine: Engine, events: list[NewEvent], per_transaction: int = 100) -> list[Any]:
    ids: list[Any] = []
    for start in range(0, len(events), per_transaction):
        with Session(engine) as session, session.begin():
            ids += add_events(session, events[start : start + per_transaction])
    return ids


def outbox_event(**overrides: Any) -> OutboxEvent:
    """An event as the relay reads it from the outbox, with every field set (``overrides``
    change some): what envelope and dead-letter tests encode and decode."""
    values = dict(
        id=uuid.uuid4(),
        seq=7,
        aggregate_type="order",
        aggregate_id="o-1",
        ordering_key="order:o-1",
        event_type="order.placed",
        event_version=2,
        payload_json='{"total":42,"items":["a","é"]}',
        headers_json=json.dumps(
            {
                "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                "correlation_id": "c-1",
                "causation_id": "x-1",
                "tenant": "t",
            }
        ),
        attempts=1,
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
    values.update(overrides)
    return OutboxEvent(**values)


@contextmanager
def running_relay(runtime: Runtime, registry: Registry, **options: Any) -> Iterator[Relay]:
    relay = Relay(
        runtime.settings, registry, runtime.publisher, dispatch=runtime.dispatcher, **options
    )
    thread = threading.Thread(target=relay.run, name="test-relay", daemon=True)
    thread.start()
    try:
        if relay.listener is not None or options.get("listen", True):
            wait_until(lambda: relay.listener is not None and relay.listener.connected.is_set())
        yield relay
    finally:
        relay.shutdown()
        thread.join(timeout=15)
        assert not thread.is_alive(), "relay did not stop"


_APP_REGISTRIES: dict[str, Registry] = {}


def app_registry(module: str) -> Registry:
    """The consumers that test app ``module`` registers, in a registry of their own.

    Importing the module registers its consumers (and routes without a handler) in the
    process-wide registry; they are moved out of it on first use (the import is cached, so
    once per process), so an in-process worker runs exactly the app's consumers and later
    tests do not see them.
    """
    if module not in _APP_REGISTRIES:
        # The import runs with the process-wide registry emptied: another app's consumer of
        # the same name (registered there by a test module's import) would refuse it.
        lent = list(global_registry.all())
        for subscription in lent:
            global_registry.remove(subscription.consumer)
        try:
            importlib.import_module(module)
            fresh = list(global_registry.all())
            for subscription in fresh:
                global_registry.remove(subscription.consumer)
        finally:
            for subscription in lent:
                if _defined_in(subscription) != module:
                    global_registry.add(subscription)
        private = Registry()
        for subscription in [*fresh, *(s for s in lent if _defined_in(s) == module)]:
            private.add(subscription)
        _APP_REGISTRIES[module] = private
    return _APP_REGISTRIES[module]


def _defined_in(subscription: Any) -> str | None:
    """The module of the subscription's handler function (None: a route without one)."""
    function = getattr(subscription.handler, "function", None)
    return None if function is None else str(function.__module__)


@contextmanager
def app_in_global_registry(module: str) -> Iterator[None]:
    """Test app ``module``'s consumers in the process-wide registry, for one CLI command.

    A command run in this process (click's ``CliRunner``) finds consumers as in a process
    of its own, by importing ``PIPELINE_APP_MODULES`` into the process-wide registry; the
    import is cached, so they are lent from :func:`app_registry` instead. A consumer of the
    same name already there (another app's) steps aside meanwhile; afterwards the registry
    is as it was before (:func:`global_registry_kept`).
    """
    with global_registry_kept():
        for subscription in app_registry(module).all():
            if subscription.consumer == CANARY_CONSUMER:
                # added by a runtime built on the app's registry (build_runtime adds the
                # built-in canary): an import of the app, as in a process, registers none
                continue
            global_registry.remove(subscription.consumer)
            global_registry.add(subscription)
        yield


@contextmanager
def global_registry_kept() -> Iterator[None]:
    """The process-wide registry as it was before, whatever was registered meanwhile.

    An app imported into that registry during a test (the demo's routes loaded in this
    process, a module imported by ``monkeypatch.setattr("module.NAME", ...)``, a command's
    ``--app``) would otherwise stay there, and a later test's app with a consumer of the
    same name (``payments``, ``ledger``) would be refused at its import or, worse, run the
    other app's handler. Such a module is dropped from the import cache as its consumers
    are removed, so that its next import registers them again (cached without them,
    :func:`app_registry` would find it has none). The test apps lent by
    :func:`app_registry` stay cached: their consumers are kept apart.
    """
    before = global_registry.all()
    try:
        yield
    finally:
        for subscription in global_registry.all():
            module = _defined_in(subscription)
            if subscription not in before and module and module not in _APP_REGISTRIES:
                sys.modules.pop(module, None)
        global_registry.clear()
        for subscription in before:
            global_registry.add(subscription)


@contextmanager
def running_worker(runtime: Runtime, threads: int = 4) -> Iterator[dramatiq.Worker]:
    """Dramatiq's worker in this process, on the runtime's real Redis broker.

    What ``pipeline worker`` runs in each of its processes, minus the process: for tests
    about what the inbox does, not about processes dying (those start ``pipeline worker``).
    """
    worker = dramatiq.Worker(runtime.broker, worker_threads=threads, worker_timeout=100)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop(timeout=15_000)


@contextmanager
def running_app_worker(settings: Settings, app: str, threads: int = 4) -> Iterator[dramatiq.Worker]:
    """Dramatiq's worker in this process for the consumers of test ``app`` (no relay)."""
    runtime = build_runtime(settings, app_registry(app), set_global_broker=False)
    try:
        with running_worker(runtime, threads) as worker:
            yield worker
    finally:
        runtime.close()


@contextmanager
def running_pipeline(
    settings: Settings, app: str, threads: int = 4, **relay_options: Any
) -> Iterator[Runtime]:
    """A relay (a thread) and a worker in this process, for the consumers of test ``app``."""
    runtime = build_runtime(settings, app_registry(app), set_global_broker=False)
    try:
        with (
            running_worker(runtime, threads),
            running_relay(runtime, runtime.registry, **relay_options),
        ):
            yield runtime
    finally:
        runtime.close()


@dataclass
class Ran:
    """How a ``pipeline`` command ended: its exit code and what it printed on each stream."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(args: Sequence[str], env: dict[str, str]) -> Ran:
    """``pipeline ARGS`` in this process (click's ``CliRunner``) with ``env`` set meanwhile.

    The same group, exit codes and one-line errors as the console script, without an
    interpreter start; the test apps in ``PIPELINE_APP_MODULES`` are lent to the
    process-wide registry for the command (:func:`app_in_global_registry`).
    """
    from click.testing import CliRunner

    from pipeline.tools.cli import cli

    with ExitStack() as stack:
        for module in filter(None, env.get("PIPELINE_APP_MODULES", "").split(",")):
            stack.enter_context(app_in_global_registry(module.strip()))
        result = CliRunner().invoke(
            cli, list(args), env=env, prog_name="pipeline", catch_exceptions=False
        )
    return Ran(result.exit_code, result.stdout, result.stderr)


def run_cli_process(args: Sequence[str], env: dict[str, str], timeout: float = 120) -> Ran:
    """``python -m pipeline.tools.cli ARGS`` in a child process: for end-to-end checks."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.tools.cli", *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Ran(done.returncode, done.stdout, done.stderr)


FIELDS_FOR_SUBPROCESSES = (
    "lease_seconds",
    "batch_size",
    "worker_timeout_ms",
    "poll_interval_max",
    "broker_heartbeat_timeout_ms",
    "broker_maintenance_chance",
    "canary_interval",
    "redelivery_horizon_seconds",
    "reconcile_interval_seconds",
)


def pipeline_env(settings: Settings, app: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # A multiprocess metrics directory left in this process's environment by an earlier
    # test would send a relay's metrics to files instead of its /metrics endpoint.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(
        PIPELINE_DATABASE_URL=settings.require_database_url(),
        PIPELINE_REDIS_URL=settings.require_redis_url(),
        PIPELINE_REDIS_NAMESPACE=settings.redis_namespace,
        PIPELINE_SCHEMA_NAME=settings.schema_name,
        PIPELINE_APP_MODULES=app,
        PYTHONPATH=str(ROOT),
    )
    for field in FIELDS_FOR_SUBPROCESSES:
        env[f"PIPELINE_{field.upper()}"] = str(getattr(settings, field))
    for field in ("message_key", "message_key_previous"):
        secret = getattr(settings, field)
        if secret is not None:
            env[f"PIPELINE_{field.upper()}"] = secret.get_secret_value()
    env.update(extra)
    return env


def start_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    return subprocess.Popen(
        argv, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
    )


def cli_argv(*args: str) -> list[str]:
    """The command line of ``pipeline ARGS`` in a fresh interpreter of this venv."""
    return [sys.executable, "-m", "pipeline.tools.cli", *args]


def worker_argv(processes: int, threads: int, *args: str) -> list[str]:
    """``pipeline worker`` with ``processes`` x ``threads`` (and ``args``)."""
    return cli_argv("worker", "--processes", str(processes), "--threads", str(threads), *args)


def start_worker(
    settings: Settings, app: str, log: Path, processes: int = 1, threads: int = 4, **env: str
) -> subprocess.Popen[bytes]:
    return start_process(worker_argv(processes, threads), pipeline_env(settings, app, **env), log)


def multiprocess_metric(directory: Path, name: str, **labels: str) -> float:
    """Sum a metric's samples written by worker processes in ``PROMETHEUS_MULTIPROC_DIR``."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    total = 0.0
    try:
        families = list(registry.collect())
    except (struct.error, FileNotFoundError):  # a worker is creating or removing its file
        return 0.0
    for family in families:
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def process_metric(name: str, **labels: str) -> float:
    """Sum a metric's samples in this process's default registry (what an in-process
    worker counts; the counters add up over the tests of a run, so compare before/after)."""
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


class Counted:
    """This process's counters (:func:`process_metric`) since this was made: ``metrics``
    names each one's (name, labels); calling it with a name gives the difference."""

    def __init__(self, **metrics: tuple[str, dict[str, str]]) -> None:
        self.metrics = metrics
        self.before = {key: self._total(key) for key in metrics}

    def _total(self, key: str) -> float:
        name, labels = self.metrics[key]
        return process_metric(name, **labels)

    def __call__(self, key: str) -> float:
        return self._total(key) - self.before[key]


@contextmanager
def process_log(level: int = logging.INFO) -> Iterator[io.StringIO]:
    """What this process logs meanwhile, formatted as a ``pipeline`` command writes it
    (console format, message bodies withheld by the same filter): an in-process worker's
    log, asserted on as a worker process's log file is."""
    from pipeline.observability.logging import ConsoleFormatter, WithoutMessageBodies

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(ConsoleFormatter())
    handler.addFilter(WithoutMessageBodies())
    root = logging.getLogger()
    level_before = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level_before)


def start_relay(
    settings: Settings, app: str, log: Path, *args: str, **env: str
) -> subprocess.Popen[bytes]:
    return start_process(cli_argv("relay", *args), pipeline_env(settings, app, **env), log)


def _group_threads(group: int) -> list[str]:
    """The states (``/proc``'s one-letter codes) of every thread of process group ``group``."""
    states: list[str] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != group:
                continue
            for task in os.listdir(f"/proc/{entry}/task"):
                task_stat = Path(f"/proc/{entry}/task/{task}/stat").read_text()
                states.append(task_stat.rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # the process or thread ended meanwhile
    return states


def freeze_group(group: int, timeout: float = 30) -> None:
    """SIGSTOP process group ``group`` and return once every thread of it has stopped.

    ``killpg`` only queues the signal: each thread stops when it is next scheduled, which on
    a busy machine can be tens of milliseconds later, long enough to run a few statements.
    """
    os.killpg(group, signal.SIGSTOP)
    wait_until(
        lambda: all(state in "tTZX" for state in _group_threads(group)),  # or dead
        timeout=timeout,
        interval=0.005,
    )


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """SIGTERM the main process (it stops its own children); SIGKILL the whole group."""
    if process.poll() is None:
        if sig == signal.SIGKILL:
            os.killpg(process.pid, sig)
        else:
            os.kill(process.pid, sig)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


class OtlpReceiver:
    """A local OTLP/HTTP endpoint on 127.0.0.1 that keeps every request: (path, type, body)."""

    def __init__(self) -> None:
        received: list[tuple[str, str, bytes]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.append((self.path, self.headers.get("Content-Type", ""), body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[tuple[dict[str, str], Any]]:
        """Every span received (decoded protobuf), with its resource's string attributes."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        found: list[tuple[dict[str, str], Any]] = []
        for _, _, body in list(self.received):
            for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    found += [(resource, span) for span in scope.spans]
        return found

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def otlp_attributes(message: Any) -> dict[str, object]:
    """A protobuf span's (or link's, or event's) attributes as plain values."""
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in message.attributes}
