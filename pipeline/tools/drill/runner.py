"""``pipeline drill``: orders through a real pipeline while faults hit it, then exact checks.

1. Servers: throwaway Postgres and Redis of its own (which it may restart), or the ones
   given with ``--database-url``/``--redis-url`` (staging: never restarted; the drill
   works in a schema and a Redis namespace of its own, dropped at the end). With
   ``--transport amqp`` a RabbitMQ cluster of its own instead of Redis (:mod:`.rabbit`).
2. Proxies in front of both, through which every relay and worker connects (on RabbitMQ,
   one per node, for the workers only).
3. The payment/e-mail API (``python -m pipeline.tools.harness.payment_api``), relays and workers
   (``pipeline relay``/``pipeline worker`` with ``PIPELINE_APP_MODULES=pipeline.tools.drill.app``),
   all children of one :class:`~pipeline.tools.harness.fleet.Fleet` that end with the drill
   however it ends; waiting for them to start is bounded by their progress
   (:mod:`pipeline.tools.harness.readiness`).
4. Orders at ``--rate`` while the faults of the seeded schedule are injected.
5. Recovery: wait until every (event, consumer) pair is done and nothing is unsent, at
   most ``--recovery-timeout`` seconds after the last fault.
6. The checks (:mod:`.check`) and the report (:mod:`.report`); exit 1 on any violation.

Whatever was started is stopped again, newest first, on success, error or Ctrl-C
(:mod:`pipeline.tools.harness.cleanup`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import click
import httpx
import psycopg
from sqlalchemy.exc import DBAPIError

from pipeline.config import Settings, configure, libpq_url, load_settings
from pipeline.errors import PipelineError
from pipeline.redaction import redact_url
from pipeline.tools.drill.check import check_run
from pipeline.tools.drill.faults import (
    HOSTS_ONLY,
    KINDS,
    OWNED_ONLY,
    RABBIT_ONLY,
    REDIS_ALONE,
    SENTINEL_ONLY,
    Fault,
    Injector,
    Proxies,
    schedule,
)
from pipeline.tools.drill.members import Kind, Member, Members
from pipeline.tools.drill.network import DEGRADE, PROXY_KINDS, DrillHosts, NetworkFaults
from pipeline.tools.drill.proxy import ProxyProcess
from pipeline.tools.drill.report import (
    RunFacts,
    build_report,
    duplicates_from_metrics,
    exit_code,
    render_text,
)
from pipeline.tools.drill.sql import DrillQueries
from pipeline.tools.drill.workflow import (
    API_URL_ENV,
    APP_SCHEMA_ENV,
    CONSUMERS,
    EVENT_TYPES,
    ROUTES,
)
from pipeline.tools.drill.workload import Producer, SkewSegment, plan_orders
from pipeline.tools.harness.cleanup import Cleanup
from pipeline.tools.harness.fleet import Child, Fleet
from pipeline.tools.harness.readiness import wait_ready
from pipeline.transport.namespace import delete_namespace

APP_MODULE = "pipeline.tools.drill.app"
SETTLE_SECONDS = 3.0
PROGRESS_INTERVAL = 5.0
RESTART_DELAY = 1.0
PROCESS_DEFAULTS = {
    # Set for the drill's relays and workers unless the environment sets them: delivery
    # owed in Postgres is re-sent after 3 s (checked every second), a killed relay's
    # claims expire after 5 s, a killed worker's messages are requeued after 15 s.
    "PIPELINE_REDELIVERY_HORIZON_SECONDS": "3",
    "PIPELINE_RECONCILE_INTERVAL_SECONDS": "1",
    "PIPELINE_LEASE_SECONDS": "5",
    "PIPELINE_BROKER_HEARTBEAT_TIMEOUT_MS": "15000",
}


class DrillError(PipelineError):
    """The drill could not run (a server or process did not start, bad options)."""


@dataclass(frozen=True)
class DrillOptions:
    events: int = 2000
    faults: int = 13
    seed: int | None = None
    rate: float = 100.0
    fault_kinds: tuple[str, ...] = ()
    recovery_timeout: float = 120.0
    database_url: str | None = None
    redis_url: str | None = None
    keep: bool = False
    as_json: bool = False
    relays: int = 2
    workers: int = 2
    processes: int = 1
    threads: int = 4
    poison: int = 3
    hosts: bool = False
    network_seconds: float = 30.0
    sentinel: bool = False
    transport: str = "redis"  # or "amqp": the drill's own RabbitMQ cluster
    rabbit_nodes: int = 3


def allowed_kinds(options: DrillOptions) -> tuple[str, ...]:
    """The fault kinds this run may inject: never a restart of a server it did not start;
    network faults across hosts only, proxy faults only on one host, Redis faults only on
    Redis and RabbitMQ faults only on the drill's RabbitMQ cluster."""
    given = {"postgres": options.database_url is not None, "redis": options.redis_url is not None}
    amqp = options.transport == "amqp"
    if amqp and (options.sentinel or given["redis"]):
        raise DrillError(
            "--transport amqp runs the drill's own RabbitMQ cluster instead of Redis: "
            "drop --sentinel/--redis-url"
        )
    if options.hosts and (given["postgres"] or given["redis"]):
        raise DrillError(
            "--hosts puts the drill's own Postgres and broker on hosts of their own: "
            "drop --database-url/--redis-url"
        )

    if options.sentinel and given["redis"]:
        raise DrillError(
            "--sentinel starts the drill's own Redis master, replica and sentinels: "
            "drop --redis-url"
        )

    def refusal(kind: str) -> str | None:
        if amqp and kind in REDIS_ALONE | SENTINEL_ONLY:
            return "acts on Redis, which --transport amqp replaces (use the rabbit-* kinds)"
        if kind in RABBIT_ONLY and not amqp:
            return "acts on the drill's RabbitMQ cluster: run with --transport amqp"
        if kind == "rabbit-no-majority" and options.rabbit_nodes < 3:
            return "needs three RabbitMQ nodes (--rabbit-nodes 3)"
        if kind in OWNED_ONLY and given["postgres" if kind.startswith("postgres") else "redis"]:
            return (
                "restarts a server, which the drill does only to servers it starts itself "
                "(drop --database-url/--redis-url for it)"
            )
        if kind in HOSTS_ONLY and not options.hosts:
            return "cuts links between hosts: run with --hosts"
        if kind in (*PROXY_KINDS, "rabbit-stall") and options.hosts:
            return "acts through the proxies, which do not run across hosts"
        if kind in SENTINEL_ONLY and not options.sentinel:
            return "needs a Redis watched by Sentinel: run with --sentinel"
        if kind in REDIS_ALONE and options.sentinel:
            return "restarts the one Redis process, which --sentinel replaces (use sentinel-*)"
        return None

    possible = tuple(kind for kind in KINDS if refusal(kind) is None)
    if not options.fault_kinds:
        return possible
    unknown = [kind for kind in options.fault_kinds if kind not in KINDS]
    if unknown:
        raise DrillError(f"unknown fault kind {unknown[0]!r}; known: {', '.join(KINDS)}")
    for kind in options.fault_kinds:
        reason = refusal(kind)
        if reason is not None:
            raise DrillError(f"fault kind {kind!r} {reason}")
    return tuple(dict.fromkeys(options.fault_kinds))


def _say(text: str) -> None:
    click.echo(f"drill: {text}", err=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_drill(options: DrillOptions) -> int:
    """Run the drill; returns the exit code (0 passed, 1 violations, 130 interrupted)."""
    cleanup = Cleanup(_say)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    drill: _Drill | None = None
    try:
        drill = _Drill(options, cleanup)
        return drill.run()
    except DrillError:
        if drill is not None:
            drill.keep_logs = True  # the message points at them
        raise
    except KeyboardInterrupt:
        _say("interrupted: stopping everything the drill started")
        return 130
    finally:
        cleanup.close()
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _Servers:
    database_url: str  # direct, for the drill itself
    redis_url: str
    postgres: Any = None  # OwnedPostgres when the drill started it
    redis: Any = None
    setup: dict[str, str] = field(default_factory=dict)
    sentinel: Any = None  # SentinelSet with --sentinel
    rabbit: Any = None  # OwnedRabbit with --transport amqp


class _Drill:
    def __init__(self, options: DrillOptions, cleanup: Cleanup) -> None:
        self.options = options
        self.cleanup = cleanup
        self.kinds = allowed_kinds(options)
        self.seed = (
            options.seed if options.seed is not None else random.SystemRandom().randrange(2**31)
        )
        self.rng = random.Random(self.seed)
        self.run_id = uuid.uuid4().hex[:8]
        self.schema = f"drill_{self.run_id}"
        self.app_schema = f"drill_{self.run_id}_app"
        self.queries = DrillQueries(self.schema, self.app_schema)
        self.started = time.time()
        self.keep_logs = options.keep
        self.notes: list[str] = []
        self.restart_at: dict[str, float] = {}
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"pipeline-drill-{self.run_id}-"))
        self.fleet = Fleet()
        self.hosts: DrillHosts | None = None

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> int:
        # The fleet's undo is pushed first, so it runs last: by then everything it holds
        # was stopped, and its watchdog is told there is nothing left to undo.
        self.fleet.open()
        self.cleanup.push("stop the drill's watchdog", self.fleet.close)
        if not self.options.keep:
            self.fleet.remove_on_death(self.work_dir)
        self.cleanup.push("remove the drill's directory", self._remove_work_dir)
        if self.options.hosts:
            self._make_hosts()
        servers = self._servers()
        settings = load_settings().replace(
            database_url=servers.database_url,
            redis_url=servers.redis_url,
            schema_name=self.schema,
            redis_namespace=self.schema,
            app_modules=APP_MODULE,
        )
        if servers.rabbit is not None:
            settings = settings.replace(broker_management_url=servers.rabbit.management_url)
        configure(settings)
        self.cleanup.push("reset the settings", lambda: configure(None))
        self._prepare_database(settings, servers)
        proxies = self._proxies(servers)
        api_url = self._start_api()
        members = self._start_members(settings, servers, proxies, api_url)
        return self._drive(settings, servers, proxies, members, api_url)

    def _drive(
        self,
        settings: Settings,
        servers: _Servers,
        proxies: Proxies,
        members: Members,
        api_url: str,
    ) -> int:
        options = self.options
        plan = plan_orders(self.run_id, options.events, options.poison, self.rng)
        window = len(plan) / options.rate if options.rate > 0 else len(plan) / 200.0
        faults = schedule(
            self.kinds, options.faults, window, self.rng, options.network_seconds, proxies.broker
        )
        segments, skews = self._segments(faults, len(plan), window)
        injected = [f for f in faults if f.kind != "clock-skew"]
        injector = Injector(
            members,
            servers.database_url,
            self.queries,
            proxies,
            self.rng,
            postgres=servers.postgres,
            redis=servers.redis,
            sentinel=servers.sentinel,
            rabbit=self._rabbit_faults(servers, proxies, members),
            wait=lambda seconds: self._wait(members, seconds),
            network=(
                NetworkFaults(
                    self.hosts, members, self.rng, lambda seconds: self._wait(members, seconds)
                )
                if self.hosts is not None
                else None
            ),
        )
        from pipeline.db.connect import make_engine

        engine = make_engine(settings, pool_size=2, pool_pre_ping=True)
        self.cleanup.push("close the producer's connections", engine.dispose)
        producer = Producer(
            engine,
            self.queries,
            plan,
            options.rate,
            segments,
            self.fleet,
            self._skewed_command,
            self._skewed_env(servers.database_url),
            lambda segment, began, ended, detail: self._skew_done(
                skews, segment, began, ended, detail
            ),
        )
        clock_offset = self._clock_offset(servers.database_url)
        kinds = ", ".join(sorted({f.kind for f in faults})) or "none"
        _say(
            f"run {self.run_id}, seed {self.seed}: {len(plan)} orders at "
            f"{options.rate:g}/s, {len(faults)} faults ({kinds})"
        )
        self._produce(members, producer, injector, injected, len(plan), window)
        done_faults = injector.done + list(skews.values())
        last_fault = max((f.ended for f in done_faults if f.ended is not None), default=0.0)
        last_order = producer.finished_at or time.time()
        recovery_from = max(last_fault, last_order)
        recovery_after = "the last fault" if last_fault >= last_order else "the last order"
        recovered_at = self._recover(members, servers.database_url, recovery_from)
        facts = RunFacts(
            run=self.run_id,
            seed=self.seed,
            options={
                k: v for k, v in asdict(options).items() if k not in ("database_url", "redis_url")
            },
            setup=servers.setup,
            started=self.started,
            faults=done_faults,
            exits=members.exits,
            recovery_from=recovery_from,
            recovery_after=recovery_after,
            recovered_at=recovered_at,
            recovery_timeout=options.recovery_timeout,
            clock_offset=clock_offset,
            duplicates_absorbed=duplicates_from_metrics(members.metrics_dirs()),
            wall_seconds=0.0,
            production_seconds=(
                producer.finished_at - self.started if producer.finished_at is not None else None
            ),
            notes=self.notes,
        )
        ledger = self._ledger(api_url)
        with self._connect(servers.database_url) as conn:
            check = check_run(conn, self.queries, ledger)
        facts.wall_seconds = time.time() - self.started
        report = build_report(facts, check)
        if not report["ok"]:
            self.keep_logs = True
            report["notes"].append(f"process logs kept in {self.work_dir}")
        click.echo(json.dumps(report, indent=2) if options.as_json else render_text(report))
        return exit_code(report)

    def _produce(
        self,
        members: Members,
        producer: Producer,
        injector: Injector,
        faults: list[Fault],
        orders: int,
        window: float,
    ) -> None:
        """Place the orders while injecting the faults as they fall due, one after another.

        A fault falls due when production reaches its share of the orders (its offset in
        the planned window), so faults spread over the orders even when the machine places
        them slower than ``--rate``.
        """
        self.started = time.time()
        began = time.monotonic()
        producer.start()

        def stop_producer() -> None:
            producer.stop.set()
            producer.join(30)

        self.cleanup.push("stop the producer", stop_producer)
        pending = sorted(faults, key=lambda f: f.offset)
        shown = began
        while pending or producer.is_alive():
            self._watch(members, producer)
            due = pending and (
                producer.placed >= pending[0].offset / window * orders or not producer.is_alive()
            )
            if due:
                fault = pending.pop(0)
                injector.inject(fault)
                _say(f"+{time.time() - self.started:6.1f} s {fault.kind}: {fault.detail}")
                continue
            if time.monotonic() - shown >= PROGRESS_INTERVAL:
                shown = time.monotonic()
                _say(f"+{time.time() - self.started:6.1f} s placed {producer.placed}/{orders}")
            time.sleep(0.05)
        self._watch(members, producer)

    # -- set-up ----------------------------------------------------------------------------
    def _servers(self) -> _Servers:
        options = self.options
        from pipeline.tools.drill.servers import OwnedPostgres, OwnedRedis
        from pipeline.tools.harness.embedded import EmbeddedServerError

        setup: dict[str, str] = {}
        postgres = redis = sentinel = rabbit = None
        try:
            if options.database_url is None:
                postgres = OwnedPostgres(self.hosts["pg"] if self.hosts else None)
                self.cleanup.push(
                    "stop the drill's Postgres", lambda: postgres.close(self.options.keep)
                )
                postgres.start()
                database_url = postgres.url
                setup["postgres"] = (
                    "the drill's own (throwaway, fsync off; restarted by the drill)"
                    + (f", data kept in {postgres.data_dir}" if options.keep else "")
                )
            else:
                database_url = libpq_url(options.database_url)
                setup["postgres"] = f"given {redact_url(database_url)} (never restarted)"
            if options.transport == "amqp":
                rabbit = self._start_rabbit()
                redis_url = rabbit.url
                setup["rabbitmq"] = (
                    f"the drill's own cluster of {options.rabbit_nodes} node(s) (throwaway, "
                    "quorum queues; nodes killed, stopped and restarted by the drill)"
                    + (" on the broker host" if self.hosts else "")
                )
            elif options.sentinel:
                from pipeline.tools.harness.sentinel import SentinelSet

                sentinel = SentinelSet(self.hosts["broker"] if self.hosts else None)
                self.cleanup.push("stop the drill's Redis and sentinels", sentinel.close)
                sentinel.start()
                redis_url = sentinel.url
                setup["redis"] = (
                    "the drill's own master, replica and three sentinels (throwaway, no "
                    "persistence; failed over by the drill)"
                    + (" on the broker host" if self.hosts else "")
                )
            elif options.redis_url is None:
                redis = OwnedRedis(self.hosts["broker"] if self.hosts else None)
                self.cleanup.push("stop the drill's Redis", lambda: redis.close(self.options.keep))
                redis.start()
                redis_url = redis.url
                setup["redis"] = "the drill's own (throwaway, AOF fsync always between faults)" + (
                    f", data kept in {redis.data_dir}" if options.keep else ""
                )
            else:
                redis_url = options.redis_url
                setup["redis"] = f"given {redact_url(redis_url)} (never restarted)"
        except EmbeddedServerError as exc:
            raise DrillError(
                f"cannot start a throwaway server: {str(exc).splitlines()[0]} (install the "
                "extra: pip install 'outbox-pipeline[embedded]', or pass --database-url and "
                "--redis-url)"
            ) from None
        setup["schemas"] = f"{self.schema} (pipeline), {self.app_schema} (orders, effects)"
        if rabbit is not None:
            setup["queues"] = f"{self.schema}.*"
        else:
            setup["redis keys"] = f"{self.schema}:*"
        setup["processes"] = (
            f"{options.relays} relays, {options.workers} workers x {options.processes} "
            f"processes x {options.threads} threads, "
            + (
                f"each on a host of its own ({self.hosts.layout()})"
                if self.hosts is not None
                else "connected through the drill's proxies"
                + (" (relays straight to the RabbitMQ nodes)" if rabbit is not None else "")
            )
        )
        return _Servers(database_url, redis_url, postgres, redis, setup, sentinel, rabbit)

    def _start_rabbit(self) -> Any:
        """The drill's own RabbitMQ cluster; its nodes' data and logs in the work directory."""
        from pipeline.errors import BinaryNotFoundError, ServerStartError
        from pipeline.tools.drill.rabbit import OwnedRabbit

        host = self.hosts["broker"] if self.hosts else None
        rabbit = OwnedRabbit(self.options.rabbit_nodes, self.work_dir / "rabbitmq", host)
        self.cleanup.push("stop the drill's RabbitMQ nodes", rabbit.close)
        where = f" on the broker host ({host.address})" if host is not None else ""
        _say(f"starting {self.options.rabbit_nodes} RabbitMQ node(s){where}")
        try:
            rabbit.start()
        except (BinaryNotFoundError, ServerStartError) as exc:
            raise DrillError(f"cannot start the drill's RabbitMQ: {exc}") from None
        return rabbit

    def _rabbit_faults(self, servers: _Servers, proxies: Proxies, members: Members) -> Any:
        if servers.rabbit is None:
            return None
        from pipeline.tools.drill.rabbit import RabbitFaults

        def sent() -> int:
            return int(self._query(servers.database_url, "sent_events")[0][0])

        return RabbitFaults(
            servers.rabbit,
            self.schema,
            self.rng,
            sent,
            lambda seconds: proxies.send(proxies.broker, f"stall {seconds:.2f}"),
            lambda: sum(proxy.stats().open for proxy in proxies.by_name[proxies.broker]),
            lambda seconds: self._wait(members, seconds),
        )

    def _prepare_database(self, settings: Settings, servers: _Servers) -> None:
        from pipeline.db.connect import make_engine
        from pipeline.db.migrate import upgrade
        from pipeline.driver_errors import wrap_driver_errors

        engine = make_engine(settings, pool_size=1)
        try:
            with wrap_driver_errors(settings), engine.begin() as connection:
                connection.exec_driver_sql(self.queries.text("create_schema"))
                upgrade(connection, self.schema)
                connection.exec_driver_sql(self.queries.text("create_tables"))
        except DBAPIError as exc:  # refused (privileges, a name taken): one line, no traceback
            detail = str(exc.orig or exc).strip().splitlines()
            raise DrillError(
                f"cannot prepare the database: {detail[0] if detail else type(exc).__name__}"
            ) from None
        finally:
            engine.dispose()
        if self.options.database_url is not None and not self.options.keep:
            self.cleanup.push("drop the drill's schemas", lambda: self._drop_schemas(servers))
        if self.options.redis_url is not None and not self.options.keep:
            self.cleanup.push("delete the drill's Redis keys", lambda: self._delete_keys(servers))

    def _make_hosts(self) -> None:
        """The hosts (network namespaces) of ``--hosts``; the drill's own thread, and so its
        producer, checks and payment API, runs on the ``app`` host from here on."""
        from pipeline.tools.harness.hosts import HostNetworkUnavailable

        options = self.options
        try:
            hosts = DrillHosts.create(options.relays, options.workers)
        except HostNetworkUnavailable as exc:
            raise DrillError(f"--hosts: {exc}") from None
        self.hosts = hosts
        self.cleanup.push("delete the drill's hosts", hosts.close)
        if "link-degrade" in self.kinds:
            problem = hosts.link_problem()
            if problem is not None:
                if "link-degrade" in options.fault_kinds:
                    raise DrillError(f"fault kind 'link-degrade' cannot be done here: {problem}")
                self.kinds = tuple(kind for kind in self.kinds if kind != "link-degrade")
                self.notes.append(f"link-degrade left out: {problem}")
            elif hosts.link_emulation == "tbf+nft-loss":
                self.notes.append(
                    "link-degrade: this kernel has no netem; a token bucket (tc tbf) on the "
                    f"link stands in for its delay, and nftables drops {DEGRADE[2]:g} % of "
                    "packets each way at random for its loss"
                )
            elif hosts.link_emulation == "tbf":
                self.notes.append(
                    "link-degrade: this kernel has no netem; a token bucket (tc tbf) on the "
                    "link stands in for delay and loss (no random loss: "
                    f"{hosts.loss_problem})"
                )
        stack = contextlib.ExitStack()
        stack.enter_context(hosts["app"].entered())
        self.cleanup.push("leave the app host", stack.close)

    def _place(self, member: Member, argv: Sequence[str]) -> list[str]:
        assert self.hosts is not None
        return self.hosts.of(member).command(argv)

    def _proxies(self, servers: _Servers) -> Proxies:
        from pipeline.tools.drill.servers import address

        if self.hosts is not None:
            return Proxies(None, None, "rabbitmq" if servers.rabbit is not None else "redis")
        log = (self.work_dir / "proxies.log").open("ab")
        self.cleanup.push("close the proxies' log", log.close)
        postgres = self._proxy(*address(servers.database_url, 5432), log)
        redis = None
        if servers.rabbit is not None:  # one per node: the workers' way to the cluster
            nodes = [self._proxy(*address(url, 5672), log) for url in servers.rabbit.node_urls()]
            return Proxies(postgres, nodes, "rabbitmq")
        if servers.redis_url.startswith("unix://"):
            self.notes.append("Redis is reached over a unix socket: no proxy in front of it")
        elif servers.sentinel is not None:
            self.notes.append("Redis is found through its sentinels: no proxy in front of it")
        else:
            redis = self._proxy(*address(servers.redis_url, 6379), log)
        return Proxies(postgres, redis)

    def _proxy(self, host: str, port: int, log: IO[bytes]) -> ProxyProcess:
        proxy = ProxyProcess.start(self.fleet, host, port, log)
        self.cleanup.push(f"stop the proxy to {host}:{port}", proxy.close)
        return proxy

    def _start_api(self) -> str:
        from pipeline.tools.harness.embedded import free_port

        port = free_port()
        host = self.hosts["app"].address if self.hosts is not None else "127.0.0.1"
        argv = [
            sys.executable, "-m", "pipeline.tools.harness.payment_api",
            "--host", host, "--port", str(port),
        ]  # fmt: skip
        try:
            api = self.fleet.start("payment API", argv, log_path=self.work_dir / "api.log")
        except OSError as exc:
            raise DrillError(f"cannot start the payment API: {exc}") from None
        self.cleanup.push("stop the payment API", lambda: self.fleet.stop([api], grace=10.0))
        url = f"http://{host}:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        def failed(detail: str) -> DrillError:
            return DrillError(f"the payment API did not start: {detail} (log in {self.work_dir})")

        wait_ready(
            ready,
            [api],
            died=lambda child: failed(f"exit {child.returncode}: {child.log_tail()}"),
            stalled=failed,
        )
        return url

    def _start_members(
        self, settings: Settings, servers: _Servers, proxies: Proxies, api_url: str
    ) -> Members:
        from pipeline.tools.drill.servers import through_proxy

        options = self.options
        postgres_proxy = next(iter(proxies.by_name["postgres"]), None)
        broker_proxies = proxies.by_name[proxies.broker]
        redis_proxy = broker_proxies[0] if broker_proxies and servers.rabbit is None else None
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PROMETHEUS_MULTIPROC_DIR", "PGAPPNAME", "PIPELINE_BROKER_URL")
        }
        for name, value in PROCESS_DEFAULTS.items():
            env.setdefault(name, value)
        env.update(
            PIPELINE_DATABASE_URL=(
                through_proxy(servers.database_url, postgres_proxy.port)
                if postgres_proxy
                else servers.database_url
            ),
            PIPELINE_REDIS_URL=(
                through_proxy(servers.redis_url, redis_proxy.port)
                if redis_proxy
                else servers.redis_url
            ),
            PIPELINE_SCHEMA_NAME=self.schema,
            PIPELINE_REDIS_NAMESPACE=self.schema,
            PIPELINE_APP_MODULES=APP_MODULE,
        )
        env[API_URL_ENV] = api_url
        env[APP_SCHEMA_ENV] = self.app_schema
        by_kind: dict[Kind, dict[str, str]] = {}
        if servers.rabbit is not None:
            env["PIPELINE_BROKER_MANAGEMENT_URL"] = servers.rabbit.management_url
        if servers.rabbit is not None and broker_proxies:  # across hosts: none, all direct
            by_kind["worker"] = {
                "PIPELINE_REDIS_URL": ";".join(
                    through_proxy(url, proxy.port)
                    for url, proxy in zip(servers.rabbit.node_urls(), broker_proxies, strict=True)
                )
            }
        servers.setup["settings"] = ", ".join(f"{k}={env[k]}" for k in PROCESS_DEFAULTS)
        members = Members(
            self.fleet,
            self.work_dir,
            env,
            self.run_id,
            relays=options.relays,
            workers=options.workers,
            processes=options.processes,
            threads=options.threads,
            place=self._place if self.hosts is not None else None,
            by_kind=by_kind,
        )
        self.cleanup.push(
            "stop the relays and workers", lambda: members.stop_all(self.cleanup.remaining)
        )
        members.start_all()

        def ready() -> bool:
            pids = [m.child.pid for m in members.of("relay") if m.child is not None]
            relays = self._query(
                servers.database_url,
                "relays_registered",
                {"pids": pids, "stale": settings.heartbeat_stale_seconds},
            )[0][0]
            return relays >= options.relays and all(members.ready(m) for m in members.of("worker"))

        def died(child: Child) -> DrillError:
            return DrillError(
                f"{child.name} exited at start-up: {child.log_tail(2, width=300)} "
                f"(logs in {self.work_dir})"
            )

        def stalled(why: str) -> DrillError:
            return DrillError(f"relays and workers not ready: {why} (logs in {self.work_dir})")

        wait_ready(ready, members.children(), died=died, stalled=stalled, tick=0.2)
        return members

    # -- while it runs -----------------------------------------------------------------------
    def _segments(
        self, faults: list[Fault], orders: int, window: float
    ) -> tuple[list[SkewSegment], dict[int, Fault]]:
        """Clock-skew faults as non-overlapping stretches of the plan."""
        segments: list[SkewSegment] = []
        skews: dict[int, Fault] = {}
        end = 0
        per_second = orders / window if window > 0 else orders
        for fault in sorted((f for f in faults if f.kind == "clock-skew"), key=lambda f: f.offset):
            start = max(end, int(fault.offset / window * orders) if window > 0 else 0)
            length = min(max(5, int(fault.seconds * per_second)), orders - start)
            if length <= 0:
                fault.detail = "skipped: no orders left to place"
                continue
            segments.append(SkewSegment(start, length, fault.skew))
            skews[start] = fault
            end = start + length
        return segments, skews

    def _skewed_command(self, segment: SkewSegment) -> list[str]:
        argv = [
            sys.executable, "-m", "pipeline.tools.drill.skewed",
            "--skew", f"{segment.skew_seconds:.3f}", "--rate", f"{self.options.rate:g}",
        ]  # fmt: skip
        return argv

    def _skewed_env(self, database_url: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PIPELINE_DATABASE_URL=database_url,
            PIPELINE_SCHEMA_NAME=self.schema,
        )
        env[APP_SCHEMA_ENV] = self.app_schema
        return env

    def _skew_done(
        self, skews: dict[int, Fault], segment: SkewSegment, began: float, ended: float, detail: str
    ) -> None:
        fault = skews[segment.start]
        fault.started, fault.ended = began, ended
        fault.target = f"{segment.length} orders"
        fault.detail = f"clock {segment.skew_seconds:+.0f} s; {detail}"
        _say(f"+{began - self.started:6.1f} s clock-skew: {fault.detail}")

    def _watch(self, members: Members, producer: Producer | None = None) -> None:
        """Restart processes that died on their own (1 s later); fail on a producer error."""
        now = time.monotonic()
        for member in members.reap():
            exit_ = members.exits[-1]
            _say(f"{member.name} exited with code {exit_.code}: {exit_.log_tail}")
            self.restart_at[member.name] = now + RESTART_DELAY
        for member in members.members:
            due = self.restart_at.get(member.name)
            if due is not None and now >= due:
                del self.restart_at[member.name]
                members.start(member)
        if producer is not None and producer.error is not None:
            error = producer.error
            raise DrillError(f"the producer failed: {type(error).__name__}: {error}")

    def _wait(self, members: Members, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._watch(members)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _recover(self, members: Members, database_url: str, since: float) -> float | None:
        """Wait until every delivery is done; the wall time it was, or None at the bound."""
        deadline = since + self.options.recovery_timeout
        shown = time.monotonic()
        while time.time() < deadline:
            self._watch(members)
            asked = time.monotonic()
            done, summary = self._progress(database_url)
            if done:
                at = time.time()
                self._wait(members, SETTLE_SECONDS)  # late copies must still be absorbed
                return at
            if time.monotonic() - shown >= PROGRESS_INTERVAL:
                shown = time.monotonic()
                _say(f"+{time.time() - self.started:6.1f} s waiting for recovery: {summary}")
            # Polls cost the database little: at most a third of the time on large runs.
            self._wait(members, max(0.5, 2 * (time.monotonic() - asked)))
        return None

    def _progress(self, database_url: str) -> tuple[bool, str]:
        try:
            placed, poison = self._query(database_url, "orders_placed")[0]
            counts = self._query(
                database_url,
                "delivery_counts",
                {
                    "consumers": [r.consumer for r in ROUTES],
                    "event_types": [r.event_type for r in ROUTES],
                },
            )
            unsent = self._query(database_url, "unsent_events", {"event_types": list(EVENT_TYPES)})[
                0
            ][0]
        except psycopg.OperationalError as exc:
            return False, f"database unavailable ({type(exc).__name__})"
        by_consumer = {row[0]: row for row in counts}
        owed = {}
        for route in ROUTES:
            required = placed if route.event_type == EVENT_TYPES[0] else placed - poison
            _, _, processed, dead = by_consumer.get(route.consumer, (route.consumer, 0, 0, 0))
            owed[route.consumer] = required - processed - dead
        summary = ", ".join(f"{c} {owed[c]} owed" for c in CONSUMERS) + f", {unsent} unsent"
        return all(n <= 0 for n in owed.values()) and unsent == 0, summary

    # -- reading the outcome -------------------------------------------------------------------
    def _clock_offset(self, database_url: str) -> float:
        before = time.time()
        (now,) = self._query(database_url, "database_clock")[0]
        return float(now) - (before + time.time()) / 2

    def _ledger(self, api_url: str) -> dict[str, Any]:
        try:
            response = httpx.get(f"{api_url}/ledger", params={"run": self.run_id}, timeout=60.0)
            response.raise_for_status()
            ledger: dict[str, Any] = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise DrillError(f"cannot read the payment API's ledger: {exc}") from None
        return ledger

    def _connect(self, database_url: str, timeout: float = 60.0) -> psycopg.Connection[Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return psycopg.connect(database_url, autocommit=True, connect_timeout=5)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _query(
        self, database_url: str, name: str, params: dict[str, Any] | None = None
    ) -> list[Any]:
        with self._connect(database_url) as conn:
            return conn.execute(self.queries.text(name), params or {}).fetchall()

    # -- clean-up ------------------------------------------------------------------------------
    def _drop_schemas(self, servers: _Servers) -> None:
        with self._connect(servers.database_url) as conn:
            conn.execute(self.queries.text("drop_schemas"))

    def _delete_keys(self, servers: _Servers) -> None:
        delete_namespace(servers.redis_url, self.schema)

    def _remove_work_dir(self) -> None:
        if self.keep_logs:
            _say(f"kept the drill's logs in {self.work_dir}")
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)
