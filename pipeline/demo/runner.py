"""``pipeline demo``: the whole pipeline, on real servers and processes, in one command.

1. Postgres and Redis: the configured ones (``PIPELINE_DATABASE_URL`` /
   ``PIPELINE_REDIS_URL``), else throwaway embedded servers (the ``embedded`` extra).
2. Schema: migrations, then the business tables; against a configured database the
   demo makes schemas of its own, named after the run, and drops only those.
3. Processes: ``pipeline relay`` and ``pipeline worker`` as children with
   ``PIPELINE_APP_MODULES=pipeline.demo.app``, and the payment/e-mail API in-process
   (``--external``: relay, workers and API are already running, e.g. docker-compose).
4. Load: orders at ``--rate``, one poison order, duplicate deliveries and transient
   handler failures; a progress bar until every order is confirmed or dead-lettered.
5. Summary and invariants (:mod:`pipeline.demo.report`); exit 1 when one fails.

Whatever was started is stopped again, newest first, on success, error or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import click
import httpx
import psycopg
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from pipeline.config import Settings, configure, load_settings, redact_url
from pipeline.demo.progress import Console, Snapshot
from pipeline.demo.report import CONSUMERS, RunFacts, build_summary, render_text
from pipeline.demo.services import (
    ChildProcess,
    Cleanup,
    choose_port,
    count_in_file,
    stop_all,
)
from pipeline.demo.sql import DemoQueries
from pipeline.demo.workload import (
    SKUS,
    STOCK_PER_SKU,
    DuplicateInjector,
    OrderProducer,
    run_in_background,
)
from pipeline.errors import DemoError

APP_MODULE = "pipeline.demo.app"
WORKER_READY_LINE = "Worker process is ready for action"
READY_TIMEOUT = 60.0
DUPLICATES_TIMEOUT = 20.0
TICK = 0.2


@dataclass(frozen=True)
class DemoOptions:
    events: int = 200
    rate: float = 25.0
    as_json: bool = False
    keep_running: bool = False
    poison: bool = True
    duplicate_rate: float = 0.1
    fail_rate: float = 0.05
    processes: int = 2
    threads: int = 4
    timeout: float = 90.0
    external: bool = False
    api_url: str | None = None
    worker_metrics_url: str | None = None
    keep_data: bool = False
    seed: int | None = None


@dataclass
class Layout:
    """Where this run lives: servers, schemas, Redis namespace, and what it owns."""

    settings: Settings
    app_schema: str
    own_schemas: bool
    own_namespace: bool
    setup: dict[str, str]


def run_demo(options: DemoOptions) -> int:
    """Run the demo; returns the exit code (0 ok, 1 invariant failed, 130 interrupted)."""
    console = Console(quiet=options.as_json)
    cleanup = Cleanup(console.warn)
    demo = _Demo(options, console, cleanup)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return demo.run()
    except KeyboardInterrupt:
        console.done()
        console.warn("interrupted: stopping everything the demo started")
        return 130
    except DemoError as exc:
        demo.keep_logs = True
        raise DemoError(f"{exc}{demo.logs_hint()}") from None
    finally:
        console.done()
        cleanup.close()
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM (docker stop, timeout) cleans up like Ctrl-C


class _Demo:
    def __init__(self, options: DemoOptions, console: Console, cleanup: Cleanup) -> None:
        self.options = options
        self.console = console
        self.cleanup = cleanup
        self.run_id = uuid.uuid4().hex[:8]
        self.started = time.monotonic()
        self.children: list[ChildProcess] = []
        self.keep_logs = False
        self.log_dir: Path | None = None
        self.endpoints: dict[str, str] = {}
        self.notes: list[str] = []

    def logs_hint(self) -> str:
        return f" (process logs kept in {self.log_dir})" if self.log_dir and self.children else ""

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        self._make_log_dir()
        layout = self._servers()
        settings = layout.settings
        configure(settings)
        self.cleanup.push("reset the settings", lambda: configure(None))
        from pipeline.db.connect import make_engine
        from pipeline.driver_errors import wrap_driver_errors

        engine = make_engine(settings, pool_size=4, max_overflow=4)
        self.cleanup.push("close database connections", engine.dispose)
        queries = DemoQueries(settings.schema_name, layout.app_schema)
        with wrap_driver_errors(settings):
            return self._run_on(engine, queries, layout)

    def _run_on(self, engine: Engine, queries: DemoQueries, layout: Layout) -> int:
        options = self.options
        settings = layout.settings
        self._prepare_database(engine, queries, layout)

        from pipeline.demo.payment_api import PaymentServer

        api: PaymentServer | None = None
        api_url = options.api_url
        if api_url is None and options.external:
            api_url = os.environ.get("PIPELINE_DEMO_API_URL")
        if api_url is None:
            if options.external:
                raise DemoError("--external needs --api-url (the API the workers call)")
            api = PaymentServer()  # bound now, served once the children are started
            self.cleanup.push("stop the payment API", api.stop)
            api_url = api.url
        api_url = api_url.rstrip("/")
        self.endpoints["payment API"] = api_url

        metrics_dir: Path | None = None
        if not options.external:
            metrics_dir = self._start_children(settings, layout, api_url)
        if api is not None:
            api.start()
        self._wait_ready(engine, queries)

        from pipeline.observability.tracing import configure_tracing, shutdown_tracing

        configure_tracing(settings, "pipeline-demo")
        self.cleanup.push("flush traces", shutdown_tracing)
        absorbed = self._duplicates_reader(metrics_dir)
        return self._drive(engine, queries, layout, api_url, absorbed)

    def _drive(
        self,
        engine: Engine,
        queries: DemoQueries,
        layout: Layout,
        api_url: str,
        absorbed: Callable[[], dict[str, int] | None] | None,
    ) -> int:
        options = self.options
        settings = layout.settings
        import pipeline.demo.app  # noqa: F401 - registers the demo's routes in this process
        from pipeline.registry import registry
        from pipeline.runtime import event_source
        from pipeline.transport.broker import make_broker
        from pipeline.transport.publisher import DramatiqRedisPublisher

        broker = make_broker(settings, middleware=[])
        self.cleanup.push("close the Redis connection", broker.close)
        publisher = DramatiqRedisPublisher(broker, event_source(settings))
        injector = DuplicateInjector(
            settings,
            engine,
            queries,
            self.run_id,
            registry,
            publisher,
            options.duplicate_rate,
            seed=options.seed,
        )
        producer = OrderProducer(
            engine,
            queries,
            self.run_id,
            options.events,
            options.rate,
            options.poison,
            seed=options.seed,
        )
        self.console.step(
            f"placing {options.events} orders"
            + (" + 1 poison order" if options.poison else "")
            + (f" at {options.rate:g}/s" if options.rate > 0 else "")
            + f"; re-delivering {options.duplicate_rate:.0%} of sent events, "
            f"{options.fail_rate:.0%} of handler attempts fail transiently"
        )
        if options.duplicate_rate > 0:
            self.cleanup.push(
                "stop the duplicate injector", run_in_background(injector, injector.stop)
            )
        self.cleanup.push("stop the producer", run_in_background(producer, producer.stop))
        finished = self._watch(engine, queries, producer, injector)
        injector.stop.set()
        if injector.is_alive():
            injector.join(timeout=15)
        if not finished:
            self.notes.append(f"timed out after {options.timeout:g} s before every order finished")
        counts = self._settle_duplicates(injector, absorbed)
        ledger = _fetch_ledger(api_url, self.run_id)
        facts = RunFacts(
            run=self.run_id,
            orders=options.events,
            poison=options.poison,
            placed=producer.placed,
            duplicates_injected=dict(injector.injected),
            duplicates_absorbed=counts,
            ledger=ledger,
            wall_seconds=time.monotonic() - self.started,
            setup=layout.setup,
            trace_ui_url=settings.trace_ui_url,
            duplicates_wanted=options.duplicate_rate > 0,
            endpoints=dict(self.endpoints),
            notes=list(self.notes),
        )
        summary = build_summary(engine, queries, facts)
        self.console.done()
        if options.as_json:
            click.echo(json.dumps(summary, indent=2, default=str))
        else:
            click.echo(render_text(summary))
        if not summary["ok"]:
            self.keep_logs = True
            self.console.warn(
                "invariants failed: " + ", ".join(summary["failed_invariants"]) + self.logs_hint()
            )
        if options.keep_running:
            try:
                self._keep_running(layout)
            except KeyboardInterrupt:  # the expected way to end --keep-running
                self.console.warn("stopping everything the demo started")
        return 0 if summary["ok"] else 1

    # -- set-up ----------------------------------------------------------------------------
    def _make_log_dir(self) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"pipeline-demo-{self.run_id}-"))
        log_dir = self.log_dir

        def remove() -> None:
            if not self.keep_logs:
                shutil.rmtree(log_dir, ignore_errors=True)

        self.cleanup.push("remove the demo's temporary directory", remove)

    def _servers(self) -> Layout:
        options = self.options
        base = load_settings()
        database_url = base.database_url.get_secret_value() if base.database_url else None
        redis_url = base.redis_url.get_secret_value() if base.redis_url else None
        if options.external and (database_url is None or redis_url is None):
            raise DemoError(
                "--external needs PIPELINE_DATABASE_URL and PIPELINE_REDIS_URL "
                "(the servers the running relay and workers use)"
            )
        setup: dict[str, str] = {}
        embedded_pg = database_url is None
        embedded_redis = redis_url is None
        from pipeline.testing.embedded import EmbeddedPostgres, EmbeddedRedis

        if redis_url is None:
            redis_server = EmbeddedRedis()
            self.cleanup.push("stop Redis", redis_server.cleanup)
            self.console.step("starting a throwaway Redis (deleted at exit)")
            _start_embedded(redis_server, "Redis", "PIPELINE_REDIS_URL")
            redis_url = redis_server.url
            setup["redis"] = f"embedded, throwaway ({redis_url})"
        else:
            setup["redis"] = f"PIPELINE_REDIS_URL {redact_url(redis_url)}"
        if database_url is None:
            postgres = EmbeddedPostgres(durable=False)
            self.cleanup.push("stop Postgres", postgres.cleanup)
            self.console.step(
                "starting a throwaway Postgres (durable=False: fsync off, which is fine for a "
                "demo whose data is deleted at exit)"
            )
            _start_embedded(postgres, "Postgres", "PIPELINE_DATABASE_URL")
            database_url = postgres.url
            setup["postgres"] = f"embedded, throwaway, durable=False ({database_url})"
        else:
            setup["postgres"] = f"PIPELINE_DATABASE_URL {redact_url(database_url)}"
        own = f"pipeline_demo_{self.run_id}"
        own_schemas = not embedded_pg and not options.external
        own_namespace = not embedded_redis and not options.external
        schema = own if own_schemas else base.schema_name
        app_schema = f"{own}_app" if own_schemas else "pipeline_demo"
        if options.external:
            app_schema = os.environ.get("PIPELINE_DEMO_SCHEMA", app_schema)
        namespace = own if own_namespace else base.redis_namespace
        settings = base.replace(
            database_url=database_url,
            redis_url=redis_url,
            schema_name=schema,
            redis_namespace=namespace,
            app_modules=APP_MODULE,
        )
        setup["schemas"] = f"{schema} (pipeline), {app_schema} (orders, payments, stock, ...)"
        setup["redis keys"] = f"{namespace}:*"
        if options.external:
            setup["processes"] = "external relay and workers (--external)"
        else:
            setup["processes"] = (
                f"1 relay + workers: {options.processes} processes x {options.threads} threads"
            )
        setup["faults"] = (
            f"{options.duplicate_rate:.0%} of sent events delivered twice, "
            f"{options.fail_rate:.0%} of handler attempts fail transiently, "
            + ("1 poison order" if options.poison else "no poison order")
        )
        return Layout(settings, app_schema, own_schemas, own_namespace, setup)

    def _prepare_database(self, engine: Engine, queries: DemoQueries, layout: Layout) -> None:
        from pipeline.db.migrate import upgrade

        settings = layout.settings
        schemas = [settings.schema_name, layout.app_schema]
        try:
            with engine.begin() as connection:
                if layout.own_schemas:
                    for schema in schemas:
                        connection.exec_driver_sql(queries.text("create_schema", app=schema))
                upgrade(connection, settings.schema_name)
                connection.exec_driver_sql(queries.text("create_tables"))
                connection.exec_driver_sql(
                    queries.text("seed_stock"), {"skus": SKUS, "available": STOCK_PER_SKU}
                )
        except DBAPIError as exc:
            if isinstance(exc, OperationalError):
                raise  # cannot connect: wrap_driver_errors says so in one line
            if isinstance(exc.orig, psycopg.errors.DuplicateSchema):
                raise DemoError(f"schema {schemas} already exists; run the demo again") from None
            raise DemoError(
                f"cannot prepare the database: {_first_line(exc.orig or exc)}"
            ) from None
        if layout.own_schemas:
            self.notes.append(
                f"the demo's schemas {', '.join(schemas)} are "
                + ("kept (--keep-data)" if self.options.keep_data else "dropped at exit")
            )
            if not self.options.keep_data:
                self.cleanup.push(
                    "drop the demo's schemas", lambda: _drop_schemas(engine, queries, schemas)
                )
        if layout.own_namespace and not self.options.keep_data:
            self.cleanup.push("delete the demo's Redis keys", lambda: _delete_namespace(settings))

    def _start_children(self, settings: Settings, layout: Layout, api_url: str) -> Path:
        options = self.options
        assert self.log_dir is not None
        host = settings.metrics_host
        relay_port = choose_port(host, settings.metrics_port)
        worker_port = choose_port(host, settings.worker_metrics_port)
        if worker_port == relay_port:
            worker_port = choose_port(host, 0)
        metrics_dir = self.log_dir / "worker-metrics"
        metrics_dir.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env.update(
            PIPELINE_DATABASE_URL=settings.require_database_url(),
            PIPELINE_REDIS_URL=settings.require_redis_url(),
            PIPELINE_SCHEMA_NAME=settings.schema_name,
            PIPELINE_REDIS_NAMESPACE=settings.redis_namespace,
            PIPELINE_APP_MODULES=APP_MODULE,
            PIPELINE_DEMO_API_URL=api_url,
            PIPELINE_DEMO_SCHEMA=layout.app_schema,
            PIPELINE_DEMO_FAIL_RATE=str(options.fail_rate),
        )
        self.console.step(
            f"starting a relay and {options.processes} worker processes (logs in {self.log_dir})"
        )
        cli = [sys.executable, "-m", "pipeline.cli"]
        self.children.append(
            ChildProcess.start(
                "relay",
                [*cli, "relay", "--metrics-port", str(relay_port)],
                env,
                self.log_dir / "relay.log",
            )
        )
        children = self.children
        self.cleanup.push(
            "stop the relay and workers", lambda: stop_all(children, self.cleanup.hurry)
        )
        worker_env = {**env, "PIPELINE_METRICS_MULTIPROC_DIR": str(metrics_dir)}
        argv = [
            *cli, "worker", "--processes", str(options.processes),
            "--threads", str(options.threads), "--metrics-port", str(worker_port),
        ]  # fmt: skip
        self.children.append(
            ChildProcess.start("workers", argv, worker_env, self.log_dir / "worker.log")
        )
        self.endpoints["relay metrics"] = f"http://{host}:{relay_port}/metrics"
        self.endpoints["worker metrics"] = f"http://{host}:{worker_port}/metrics"
        return metrics_dir

    def _wait_ready(self, engine: Engine, queries: DemoQueries) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        workers = self.children[1] if len(self.children) > 1 else None
        while True:
            self._check_children()
            with engine.connect() as connection:
                relays = connection.exec_driver_sql(queries.text("relays_alive")).scalar_one()
            ready = workers is None or (
                count_in_file(workers.log_path, WORKER_READY_LINE) >= self.options.processes
            )
            if relays and ready:
                break
            if time.monotonic() > deadline:
                if not relays:
                    raise DemoError(
                        f"no relay is running on schema {queries.schema!r} after "
                        f"{READY_TIMEOUT:g} s (with --external, start `pipeline relay` with "
                        f"PIPELINE_APP_MODULES={APP_MODULE})"
                    )
                raise DemoError(f"the workers were not ready after {READY_TIMEOUT:g} s")
            time.sleep(0.1)
        self.console.step(f"relay and workers ready after {time.monotonic() - self.started:.1f} s")

    def _check_children(self) -> None:
        for child in self.children:
            if not child.running():
                raise child.died()

    def _duplicates_reader(
        self, metrics_dir: Path | None
    ) -> Callable[[], dict[str, int] | None] | None:
        if metrics_dir is not None:
            return lambda: _multiprocess_duplicates(metrics_dir)
        url = self.options.worker_metrics_url
        if not url:
            self.notes.append("duplicates absorbed not measured: pass --worker-metrics-url")
            return None
        baseline = _scraped_duplicates(url)
        if baseline is None:
            raise DemoError(f"cannot read the workers' metrics at {url}")

        def delta() -> dict[str, int] | None:
            now = _scraped_duplicates(url)
            if now is None:
                return None
            return {c: now.get(c, 0) - baseline.get(c, 0) for c in CONSUMERS}

        return delta

    # -- while it runs ---------------------------------------------------------------------
    def _watch(
        self,
        engine: Engine,
        queries: DemoQueries,
        producer: OrderProducer,
        injector: DuplicateInjector,
    ) -> bool:
        """Show progress until every order is confirmed or dead-lettered; False on timeout."""
        n = self.options.events
        deadline = time.monotonic() + self.options.timeout
        params = {"run": self.run_id}
        while True:
            self._check_children()
            for thread in (producer, injector):
                if thread.error is not None:
                    raise DemoError(f"{thread.name} failed: {_first_line(thread.error)}")
            with engine.connect() as connection:
                progress = {
                    r[0]: (int(r[1]), int(r[2]))
                    for r in connection.exec_driver_sql(
                        queries.text("consumer_progress"), params
                    ).all()
                }
                unsent = sum(
                    int(r[2])
                    for r in connection.exec_driver_sql(queries.text("outbox_counts"), params)
                    if r[1] != "sent"
                )
            done = {c: progress.get(c, (0, 0))[0] for c in CONSUMERS}
            dead = sum(d for _, d in progress.values())
            self.console.progress(
                Snapshot(
                    total=producer.total,
                    placed=producer.placed,
                    charged=done["payments"],
                    reserved=done["inventory"],
                    confirmed=done["notifications"],
                    dead=dead,
                    duplicates=injector.total,
                    elapsed=time.monotonic() - self.started,
                )
            )
            complete = (
                producer.finished()
                and all(count >= n for count in done.values())
                and (dead >= 1 or not self.options.poison)
                and unsent == 0
            )
            if complete:
                self.console.done()
                self.console.step(
                    f"every order confirmed or dead-lettered after "
                    f"{time.monotonic() - self.started:.1f} s"
                )
                return True
            if time.monotonic() > deadline:
                self.console.done()
                return False
            time.sleep(TICK)

    def _settle_duplicates(
        self,
        injector: DuplicateInjector,
        absorbed: Callable[[], dict[str, int] | None] | None,
    ) -> dict[str, int] | None:
        """Wait until the inbox has absorbed every injected copy (they may still be queued)."""
        if absorbed is None:
            return None
        deadline = time.monotonic() + DUPLICATES_TIMEOUT
        counts = absorbed()
        while time.monotonic() < deadline:
            counts = absorbed()
            if counts is not None and all(
                counts.get(c, 0) >= n for c, n in injector.injected.items()
            ):
                break
            self._check_children()
            time.sleep(TICK)
        return counts

    def _keep_running(self, layout: Layout) -> None:
        settings = layout.settings
        self.console.warn(
            "still running (--keep-running): relay and workers keep serving; "
            + "; ".join(f"{name} {url}" for name, url in self.endpoints.items())
        )
        self.console.warn(
            f"PIPELINE_DATABASE_URL={redact_url(settings.require_database_url())} "
            f"PIPELINE_REDIS_URL={redact_url(settings.require_redis_url())} "
            f"PIPELINE_SCHEMA_NAME={settings.schema_name} "
            f"PIPELINE_REDIS_NAMESPACE={settings.redis_namespace} "
            "-- press Ctrl-C to stop and clean up"
        )
        while True:
            self._check_children()
            time.sleep(0.5)


# -- helpers ---------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _start_embedded(server: Any, name: str, variable: str) -> None:
    from pipeline.testing.embedded import EmbeddedServerError

    try:
        server.start()
    except EmbeddedServerError as exc:
        raise DemoError(
            f"cannot start a throwaway {name}: {str(exc).splitlines()[0]} "
            f"(install the extra: pip install 'outbox-pipeline[embedded]', or set {variable})"
        ) from None


def _drop_schemas(engine: Engine, queries: DemoQueries, schemas: list[str]) -> None:
    with engine.begin() as connection:
        for schema in schemas:
            connection.exec_driver_sql(queries.text("drop_schema", app=schema))


def _delete_namespace(settings: Settings) -> None:
    import redis

    client = redis.Redis.from_url(settings.require_redis_url())
    try:
        keys = list(client.scan_iter(match=f"{settings.redis_namespace}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


def _fetch_ledger(api_url: str, run: str) -> dict[str, Any]:
    try:
        response = httpx.get(f"{api_url}/ledger", params={"run": run}, timeout=10.0)
        response.raise_for_status()
        ledger: dict[str, Any] = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise DemoError(f"cannot read the payment API's ledger at {api_url}: {exc}") from None
    return ledger


DUPLICATES_METRIC = "pipeline_inbox_duplicates_total"


def _multiprocess_duplicates(directory: Path) -> dict[str, int] | None:
    """Per-consumer duplicates from the worker processes' prometheus multiprocess files."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    try:
        families = list(registry.collect())
    except (struct.error, OSError, ValueError):  # a file is being created: read again later
        return None
    return _duplicates_from(families)


def _scraped_duplicates(url: str) -> dict[str, int] | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(url, timeout=5.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return _duplicates_from(list(text_string_to_metric_families(response.text)))


def _duplicates_from(families: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = dict.fromkeys(CONSUMERS, 0)
    for family in families:
        for sample in family.samples:
            if sample.name == DUPLICATES_METRIC:
                consumer = sample.labels.get("consumer", "")
                counts[consumer] = counts.get(consumer, 0) + int(sample.value)
    return counts
