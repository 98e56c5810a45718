"""``pipeline demo``: the whole pipeline, on real servers and processes, in one command.

1. Postgres and Redis: the configured ones (``PIPELINE_DATABASE_URL`` /
   ``PIPELINE_REDIS_URL``), else throwaway embedded servers (the ``embedded`` extra);
   see :mod:`pipeline.tools.demo.layout`.
2. Schema: migrations, then the business tables; against a configured database the
   demo makes schemas of its own, named after the run, and drops only those.
3. Processes: ``pipeline relay`` and ``pipeline worker`` as children with
   ``PIPELINE_APP_MODULES=pipeline.tools.demo.app`` (:mod:`pipeline.tools.demo.processes`),
   and the payment/e-mail API (:mod:`pipeline.tools.harness.payment_api`) in-process
   (``--external``: relay, workers and API are already running, e.g. docker-compose).
4. Load: orders at ``--rate``, one poison order, duplicate deliveries and transient
   handler failures (:mod:`pipeline.tools.demo.workload`); a progress bar until every order is
   confirmed or dead-lettered.
5. Summary and invariants (:mod:`pipeline.tools.demo.report`); exit 1 when one fails.

Whatever was started is stopped again, newest first, within a few seconds, on success,
error, Ctrl-C or SIGTERM (:mod:`pipeline.tools.harness.cleanup`); if the demo itself is
killed, the watchdog processes of its fleet and servers (:mod:`pipeline.tools.harness.fleet`)
kill the relay, workers and servers and delete its files. Waiting for the relay and
workers to start is bounded by their progress (:mod:`pipeline.tools.harness.readiness`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import click
from sqlalchemy import Engine

from pipeline.config import configure
from pipeline.driver_errors import driver_reason
from pipeline.errors import DemoError
from pipeline.redaction import redact_url
from pipeline.tools.demo.layout import APP_MODULE, Layout, plan_layout, prepare_database
from pipeline.tools.demo.outcomes import duplicates_reader, fetch_ledger
from pipeline.tools.demo.processes import STOP_GRACE_SECONDS, died, start_pipeline
from pipeline.tools.demo.progress import Console, Snapshot
from pipeline.tools.demo.report import CONSUMERS, RunFacts, build_summary, render_text
from pipeline.tools.demo.sql import DemoQueries
from pipeline.tools.demo.workload import DuplicateInjector, OrderProducer
from pipeline.tools.harness.cleanup import Cleanup
from pipeline.tools.harness.commands import workers_ready
from pipeline.tools.harness.fleet import Child, Fleet
from pipeline.tools.harness.readiness import wait_ready

SHUTDOWN_BUDGET_SECONDS = 8.0
DUPLICATES_TIMEOUT = 20.0
THREAD_STOP_SECONDS = 2.0
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


def run_demo(options: DemoOptions) -> int:
    """Run the demo; returns the exit code (0 ok, 1 invariant failed, 130 interrupted)."""
    console = Console(quiet=options.as_json)
    cleanup = Cleanup(console.warn, SHUTDOWN_BUDGET_SECONDS)
    demo = _Demo(options, console, cleanup)
    previous = {sig: signal.signal(sig, demo.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return demo.run()
    except KeyboardInterrupt:
        demo.interrupted()
        console.done()
        console.warn("interrupted: stopping everything the demo started")
        return 130
    except DemoError as exc:
        demo.keep_logs = True
        raise DemoError(f"{exc}{demo.logs_hint()}") from None
    finally:
        console.done()
        cleanup.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {driver_reason(exc)}"


class _Demo:
    def __init__(self, options: DemoOptions, console: Console, cleanup: Cleanup) -> None:
        self.options = options
        self.console = console
        self.cleanup = cleanup
        self.run_id = uuid.uuid4().hex[:8]
        self.started = time.monotonic()
        self.children: list[Child] = []
        self.keep_logs = False
        self.log_dir: Path | None = None
        self.fleet = Fleet()
        self.endpoints: dict[str, str] = {}
        self.notes: list[str] = []
        self.stop_requested = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Ctrl-C or SIGTERM (docker stop, a timeout): stop and clean up.

        The flag outlives the exception: a KeyboardInterrupt raised while Python runs a
        finalizer is swallowed, so every waiting loop also checks the flag each tick.
        """
        self.stop_requested = True
        raise KeyboardInterrupt

    def logs_hint(self) -> str:
        return f" (process logs kept in {self.log_dir})" if self.log_dir and self.children else ""

    def interrupted(self) -> None:
        """Ctrl-C: ask the relay and workers to stop now, while the rest is undone."""
        for child in self.children:
            child.terminate()

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        self._make_log_dir()
        layout = plan_layout(self.run_id, self.options.external, self.cleanup, self.console.step)
        self._describe_setup(layout)
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
        prepare_database(engine, queries, layout, options.keep_data, self.cleanup, self.notes)

        from pipeline.tools.harness.payment_api import PaymentServer

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
            metrics_dir = self._start_children(layout, api_url)
        if api is not None:
            api.start()
        self._wait_ready(engine, queries, settings.heartbeat_stale_seconds)

        from pipeline.observability.tracing import configure_tracing, shutdown_tracing

        configure_tracing(settings, "pipeline-demo")
        self.cleanup.push("flush traces", shutdown_tracing)
        absorbed = duplicates_reader(metrics_dir, self.options.worker_metrics_url, self.notes)
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
        import pipeline.tools.demo.app  # noqa: F401 - registers the demo's routes in this process
        from pipeline.registry import registry
        from pipeline.signing import event_source
        from pipeline.transport.factory import open_transport

        transport = open_transport(settings, middleware=[])
        self.cleanup.push("close the Redis connection", transport.close)
        publisher = transport.publisher(event_source(settings))
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
            self._in_background(injector, "stop the duplicate injector")
        self._in_background(producer, "stop the producer")
        finished = self._watch(engine, queries, producer, injector)
        injector.stop.set()
        if injector.is_alive():
            injector.join(timeout=15)
        if not finished:
            self.notes.append(f"timed out after {options.timeout:g} s before every order finished")
        counts = self._settle_duplicates(injector, absorbed)
        ledger = fetch_ledger(api_url, self.run_id)
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
                self.interrupted()
                self.console.warn("stopping everything the demo started")
        return 0 if summary["ok"] else 1

    # -- set-up ----------------------------------------------------------------------------
    def _make_log_dir(self) -> None:
        # The fleet's undo is pushed first, so it runs last: its watchdog is told "nothing
        # left" once everything else is undone, and deletes the logs itself if the demo dies.
        self.fleet.open()
        self.cleanup.push("stop the fleet's watchdog", self.fleet.close)
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"pipeline-demo-{self.run_id}-"))
        log_dir = self.log_dir
        self.fleet.remove_on_death(log_dir)

        def remove() -> None:
            if not self.keep_logs:
                shutil.rmtree(log_dir, ignore_errors=True)

        self.cleanup.push("remove the demo's temporary directory", remove)

    def _describe_setup(self, layout: Layout) -> None:
        options = self.options
        if options.external:
            layout.setup["processes"] = "external relay and workers (--external)"
        else:
            layout.setup["processes"] = (
                f"1 relay + workers: {options.processes} processes x {options.threads} threads"
            )
        layout.setup["faults"] = (
            f"{options.duplicate_rate:.0%} of sent events delivered twice, "
            f"{options.fail_rate:.0%} of handler attempts fail transiently, "
            + ("1 poison order" if options.poison else "no poison order")
        )

    def _start_children(self, layout: Layout, api_url: str) -> Path:
        options = self.options
        assert self.log_dir is not None
        self.console.step(
            f"starting a relay and {options.processes} worker processes (logs in {self.log_dir})"
        )
        children = self.children

        def started(child: Child) -> None:
            if not children:
                self.cleanup.push(
                    "stop the relay and workers",
                    lambda: self.fleet.stop(children, STOP_GRACE_SECONDS, self.cleanup.remaining),
                )
            children.append(child)

        running = start_pipeline(
            self.fleet,
            layout.settings,
            self.log_dir,
            {
                "PIPELINE_APP_MODULES": APP_MODULE,
                "PIPELINE_DEMO_API_URL": api_url,
                "PIPELINE_DEMO_SCHEMA": layout.app_schema,
                "PIPELINE_DEMO_FAIL_RATE": str(options.fail_rate),
            },
            options.processes,
            options.threads,
            started,
        )
        self.endpoints.update(running.endpoints)
        return running.metrics_dir

    def _in_background(self, thread: OrderProducer | DuplicateInjector, what: str) -> None:
        """Start a load thread; its undo stops it and waits a little (it is a daemon)."""
        thread.start()

        def undo() -> None:
            thread.stop.set()
            thread.join(timeout=self.cleanup.remaining(THREAD_STOP_SECONDS))

        self.cleanup.push(what, undo)

    def _wait_ready(self, engine: Engine, queries: DemoQueries, stale: float) -> None:
        """Wait for our relay (any, with --external) and every worker process."""
        workers = self.children[1] if len(self.children) > 1 else None
        relay_pids = [self.children[0].pid] if self.children else None
        state = {"relays": 0}

        def ready() -> bool:
            with engine.connect() as connection:
                state["relays"] = connection.exec_driver_sql(
                    queries.text("relays_registered"),
                    {"pids": relay_pids, "stale": stale},
                ).scalar_one()
            return bool(state["relays"]) and (
                workers is None or workers_ready(workers, self.options.processes)
            )

        def stalled(why: str) -> DemoError:
            if not state["relays"]:
                return DemoError(
                    f"no relay is running on schema {queries.schema!r}: {why} (with "
                    f"--external, start `pipeline relay` with PIPELINE_APP_MODULES={APP_MODULE})"
                )
            return DemoError(f"the workers were not ready: {why}")

        wait_ready(ready, self.children, died=died, stalled=stalled, check=self._check_children)
        self.console.step(f"relay and workers ready after {time.monotonic() - self.started:.1f} s")

    def _check_children(self) -> None:
        """Called on every tick of every waiting loop: a stop request, or a dead child."""
        if self.stop_requested:
            raise KeyboardInterrupt
        for child in self.children:
            if not child.running():
                raise died(child)

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
                    raise DemoError(f"{thread.name} failed: {_describe(thread.error)}")
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
        if self.log_dir is not None and "relay metrics" in self.endpoints:
            from pipeline.tools.demo.prometheus import write_prometheus_setup

            setup = write_prometheus_setup(
                self.log_dir / "prometheus",
                self.endpoints["relay metrics"],
                self.endpoints["worker metrics"],
            )
            for line in setup.instructions():
                self.console.warn(line)
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
