"""The ops kit against a live Prometheus, live processes and live faults.

One environment for the whole module: Postgres (a database of its own), a Redis of its
own (the test restarts it), a real ``pipeline relay`` (reaching Postgres through a TCP
proxy the tests can stall) and ``pipeline worker`` running
``tests.apps.ops_app`` under a steady load, and a real Prometheus (its own config, port
and data directory) scraping both and evaluating a copy of the rules whose range windows
are 30 times shorter and ``for:`` durations 120 times (``shortened_rules``): the committed
rules rendered for this deployment, whose workload sends ``audit.noted`` events to no
consumer on purpose (``--allowed-unrouted-type audit.noted``); the expressions,
thresholds, labels and annotations are otherwise the committed ones.

The tests run in file order on that environment; each fault test restores what it broke.
The two playbook tests run the runbook pages' ``sh step`` blocks verbatim, with the
incident's facts in shell variables as the pages say. The poison-message playbook calls
``pipeline dlq``; it fails until that command exists.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
import yaml
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from pipeline import NewEvent, Settings, add_events, configure
from pipeline.tools.drill.proxy import ProxyProcess
from pipeline.tools.harness.embedded import EmbeddedRedis, free_port
from pipeline.tools.harness.fleet import Fleet
from pipeline.tools.opskit import KitOptions, render_rule_files
from tests.conftest import create_database, drop_database
from tests.opskit_support import (
    Prometheus,
    alert_rules,
    family,
    metric_names,
    panel_queries,
    recording_rules,
    rule_groups,
    runbook_steps,
    shortened_rules,
)
from tests.support import cli_argv, pipeline_env, start_process, stop_process, wait_until

pytestmark = pytest.mark.integration

APP = "tests.apps.ops_app"
KIT = KitOptions(allowed_unrouted_types=("audit.noted",))
FIRE_TIMEOUT = 90.0  # seconds for an alert to fire once its fault is in place
RESOLVE_TIMEOUT = 120.0
# `for: 10m` waits 5 s (2 s at least): the alerts fire sooner, the same ones go pending, and
# every second a test waits for an alert costs the load's CPU on a shared machine
FOR_SCALE = 120


class Load(threading.Thread):
    """Orders at a steady rate (each to two consumers), and now and then an unrouted event.

    Ten a second give every rate, ratio and panel samples within the shortened windows
    and a backlog within seconds of a relay's death; each order costs the worker and
    Postgres CPU for the whole module, so no more than that.
    """

    def __init__(self, engine: Engine, per_second: float = 10.0) -> None:
        super().__init__(name="ops-load", daemon=True)
        self.engine = engine
        self.interval = 2 / per_second
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.produced = 0

    def run(self) -> None:
        tick = 0
        while not self.stop.wait(self.interval):
            if self.paused.is_set():
                continue
            tick += 1
            events = [NewEvent("order.placed", {"n": tick, "i": i}) for i in range(2)]
            if tick % 12 == 0:  # one every 2.4 s
                events.append(NewEvent("audit.noted", {"n": tick}))  # nobody subscribes
            with contextlib.suppress(Exception), Session(self.engine) as session, session.begin():
                add_events(session, events)
                self.produced += len(events)


def through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by a local proxy's."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    hostport = f"127.0.0.1:{port}"
    return urlunsplit(
        parts._replace(netloc=f"{netloc[0]}@{hostport}" if len(netloc) == 2 else hostport)
    )


@dataclass
class Ops:
    settings: Settings
    engine: Engine
    redis: EmbeddedRedis
    directory: Path
    relay_port: int
    worker_port: int
    prometheus: Prometheus | None = None
    relay: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    load: Load | None = None
    by_hand: list[int] = field(default_factory=list)
    fleet: Fleet = field(default_factory=Fleet)
    postgres_proxy: ProxyProcess | None = None

    @property
    def poison_flag(self) -> Path:
        return self.directory / "orders-reject-poison"

    @property
    def fail_flag(self) -> Path:
        return self.directory / "ledger-down"

    def env(self, **extra: str) -> dict[str, str]:
        bin_dir = str(Path(sys.executable).parent)
        return pipeline_env(
            self.settings,
            APP,
            PIPELINE_METRICS_PORT=str(self.relay_port),
            PIPELINE_WORKER_METRICS_PORT=str(self.worker_port),
            PIPELINE_STATE_METRICS_INTERVAL="1",
            PIPELINE_ALLOW_UNROUTED="1",  # the workload sends unrouted events on purpose
            OPS_POISON_FLAG=str(self.poison_flag),
            OPS_FAIL_FLAG=str(self.fail_flag),
            PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            **extra,
        )

    def start_relay(self) -> None:
        """The relay reaches Postgres through a TCP proxy the tests can stall."""
        target = urlsplit(self.settings.require_database_url())
        with (self.directory / "proxy.log").open("ab") as log:
            self.postgres_proxy = ProxyProcess.start(
                self.fleet, target.hostname or "127.0.0.1", target.port or 5432, log
            )
        url = through(self.settings.require_database_url(), self.postgres_proxy.port)
        argv = cli_argv("relay")
        env = self.env(PIPELINE_DATABASE_URL=url)
        self.relay = start_process(argv, env, self.directory / "relay.log")

    def start_worker(self) -> None:
        argv = cli_argv("worker", "--processes", "1")
        argv += ["--threads", "4"]
        self.worker = start_process(argv, self.env(), self.directory / "worker.log")

    def run_steps(self, page: str, **variables: str) -> list[subprocess.CompletedProcess[str]]:
        """Run a runbook page's ``sh step`` blocks as an operator would, in its order."""
        steps = runbook_steps(page)
        assert steps, f"runbooks/{page}.md has no sh step blocks"
        results = []
        for step in steps:
            result = subprocess.run(
                ["bash", "-c", step],
                check=False,
                cwd=self.directory,
                env=self.env(**variables),
                capture_output=True,
                text=True,
                timeout=400,
            )
            results.append(result)
            self.by_hand += [
                int(p) for p in re.findall(r"started by hand, pid (\d+)", result.stdout)
            ]
        return results

    def unsent(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pipeline.outbox "
                        "WHERE status IN ('pending', 'publishing')"
                    )
                ).scalar_one()
            )

    def check_processes(self) -> None:
        """The worker and a relay run (after the relay-down playbook: the one it started)."""
        if self.relay is None:
            for pid in self.by_hand:
                os.kill(pid, 0)  # raises if that relay has exited
            log = self.directory / "pipeline-relay.log"
            assert self.by_hand, "no relay: " + log.read_text()[-3000:]
        for name, process in (("relay", self.relay), ("worker", self.worker)):
            if name == "relay" and process is None:
                continue
            assert process is not None and process.poll() is None, (
                f"{name} exited: " + (self.directory / f"{name}.log").read_text()[-3000:]
            )


@pytest.fixture(scope="module")
def ops(
    tmp_path_factory: pytest.TempPathFactory, postgres_server_url: str, template_database: str
) -> Iterator[Ops]:
    directory = tmp_path_factory.mktemp("opskit")
    redis_server = EmbeddedRedis(data_dir=directory / "redis")
    redis_server.start()
    name, url = create_database(postgres_server_url, template_database)
    settings = Settings(
        database_url=url,  # type: ignore[arg-type]
        redis_url=redis_server.url,  # type: ignore[arg-type]
        redis_namespace="opskit",
        canary_interval=1.0,
        redelivery_horizon_seconds=5.0,
        reconcile_interval_seconds=1.0,
        poll_interval_max=1.0,
    )
    configure(settings)
    engine = create_engine(settings.sqlalchemy_url(), pool_size=2)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE ops_effects (consumer text, event_id uuid)"))
    env = Ops(settings, engine, redis_server, directory, free_port(), free_port())
    try:
        env.start_relay()
        env.start_worker()
        env.prometheus = Prometheus(
            directory,
            {
                KIT.relay_job: f"127.0.0.1:{env.relay_port}",
                KIT.worker_job: f"127.0.0.1:{env.worker_port}",
            },
            shortened_rules(kit_rule_groups(), for_scale=FOR_SCALE),
        )
        env.prometheus.start()
        prometheus = env.prometheus
        wait_until(  # both targets scraped, and a canary went all the way through
            lambda: (
                len(prometheus.query("up == 1")) == 2
                and prometheus.query("pipeline_canary_last_success_timestamp_seconds > 0")
            ),
            timeout=120,
            interval=1,
            alive=[env.relay, env.worker],
        )
        # The load starts once the worker consumes: events committed while it still boots
        # (seconds on a loaded machine) wait past the 5 s SLO, and in the latency rules'
        # shortened windows that start-up backlog alone fired PipelineLatencyBudgetBurn in
        # what the tests take for normal operation.
        env.load = Load(engine)
        env.load.start()
        # every rule evaluated over windows with data in them (the first tests assert this,
        # and say what is missing if it never is)
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: (
                    not (
                        unhealthy_rules(prometheus)
                        or unproduced_records(prometheus)
                        or empty_panels(prometheus)
                    )
                ),
                timeout=120,
                interval=1,
                alive=[env.relay, env.worker],
            )
        env.check_processes()
        yield env
    finally:
        if env.load is not None:
            env.load.stop.set()
            env.load.join(timeout=10)
        for pid in env.by_hand:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for process in (env.worker, env.relay):
            if process is not None:
                stop_process(process)
        if env.prometheus is not None:
            env.prometheus.stop()
        if env.postgres_proxy is not None:
            env.postgres_proxy.close()
        env.fleet.close()
        engine.dispose()
        configure(None)
        redis_server.cleanup()
        drop_database(postgres_server_url, name)


def kit_rule_groups() -> list[dict[str, Any]]:
    """The rule groups rendered for this deployment (they differ from the committed ones
    only in the unrouted-events alert, which leaves out ``audit.noted``)."""
    groups: list[dict[str, Any]] = []
    for rule_file in render_rule_files(KIT).values():
        groups += yaml.safe_load(rule_file)["groups"]
    committed = {
        g["name"]: [r.get("alert") or r["record"] for r in g["rules"]] for g in rule_groups()
    }
    assert {
        g["name"]: [r.get("alert") or r["record"] for r in g["rules"]] for g in groups
    } == committed
    return groups


def prom(ops: Ops) -> Prometheus:
    assert ops.prometheus is not None
    return ops.prometheus


def unhealthy_rules(prometheus: Prometheus) -> list[tuple[str, Any]]:
    """Rules not yet evaluated, or whose evaluation failed (with the error)."""
    return [(r["name"], r.get("lastError")) for r in prometheus.rules() if r["health"] != "ok"]


def unproduced_records(prometheus: Prometheus) -> set[str]:
    """Recording rules without a series, except the ratios of things that have not happened
    (failures, duplicates, re-deliveries: no series until the first)."""
    expected = {
        r["record"]
        for r in recording_rules()
        if not re.search(r"failures|duplicates|redeliveries", r["record"])
    }
    return {name for name in expected if not prometheus.query(name)}


def empty_panels(prometheus: Prometheus) -> list[tuple[str, str, str, list[float]]]:
    """Dashboard panels whose query, with the variables at "All", has no finite sample."""
    empty = []
    for query in panel_queries():
        values = [float(sample["value"][1]) for sample in prometheus.query(query.promql)]
        if not any(math.isfinite(v) for v in values):
            empty.append((query.dashboard, query.panel, query.expr, values))
    return empty


# -- normal operation ------------------------------------------------------------------------


def test_every_target_is_up_and_every_rule_evaluates(ops: Ops) -> None:
    targets = prom(ops).targets()
    assert {t["labels"]["job"] for t in targets} == {KIT.relay_job, KIT.worker_job}
    assert all(t["health"] == "up" for t in targets), targets
    rules = prom(ops).rules()
    expected = {r.get("alert") or r["record"] for r in alert_rules() + recording_rules()}
    assert {r["name"] for r in rules} == expected
    assert not unhealthy_rules(prom(ops))
    assert not unproduced_records(prom(ops))


def test_every_dashboard_panel_returns_data(ops: Ops) -> None:
    """Each panel's query, with the variables at "All", returns at least one finite sample."""
    empty = empty_panels(prom(ops))
    assert not empty, "\n".join(map(str, empty))


def test_only_the_watchdog_fires_in_normal_operation(ops: Ops) -> None:
    time.sleep(10)
    firing = {a["labels"]["alertname"] for a in prom(ops).alerts()}
    pending = {a["labels"]["alertname"] for a in prom(ops).alerts("pending")}
    assert firing == {"PipelineWatchdog"}, prom(ops).alerts()
    assert not pending, prom(ops).alerts("pending")


# -- faults ----------------------------------------------------------------------------------

STALL_SECONDS = 180  # a cap: the test ends the stall once the alert has fired


def test_a_stalled_postgres_fires_postgres_unreachable_not_relay_down(ops: Ops) -> None:
    """Postgres stops answering the relay (its TCP proxy stops forwarding): the relay's
    scrapes still answer (its state is read in the background), so the alert that names
    the cause fires, not PipelineRelayDown; it resolves once the stall ends."""
    assert ops.postgres_proxy is not None
    assert ops.postgres_proxy.command(f"stall {STALL_SECONDS}").startswith("stalled")
    alert = prom(ops).wait_firing("PipelinePostgresUnreachable", STALL_SECONDS)
    assert alert["labels"]["source"] == "postgres"
    assert alert["labels"]["severity"] == "critical"
    relay_alerts = [
        a
        for a in prom(ops).api("alerts")["alerts"]
        if a["labels"]["alertname"] in {"PipelineRelayDown", "PipelineTargetDown"}
    ]
    assert relay_alerts == []  # not even pending
    up = prom(ops).query(f'up{{job="{KIT.relay_job}"}}')
    assert up and all(float(sample["value"][1]) == 1 for sample in up)
    assert ops.postgres_proxy.command("stall 0").startswith("stalled")  # the stall ends
    prom(ops).wait_resolved("PipelinePostgresUnreachable", RESOLVE_TIMEOUT)
    ops.check_processes()


def test_relay_killed_fires_relay_down_and_the_playbook_restores_the_flow(ops: Ops) -> None:
    assert ops.relay is not None
    stop_process(ops.relay, signal.SIGKILL)
    alert = prom(ops).wait_firing("PipelineRelayDown", FIRE_TIMEOUT)
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"] == KIT.runbook("PipelineRelayDown")
    assert alert["annotations"]["runbook_url"].startswith("http://localhost:8088/")
    prom(ops).wait_firing("PipelineTargetDown", FIRE_TIMEOUT, job=KIT.relay_job)
    wait_until(lambda: ops.unsent() > 50, timeout=60, interval=0.5)  # the backlog builds up

    results = ops.run_steps("relay-down")

    status, pending, started, drained = results
    backlog = re.search(r"^outbox backlog: pending (\d+)", status.stdout, re.MULTILINE)
    assert backlog and int(backlog.group(1)) > 50, status.stdout
    assert pending.returncode == 0 and "no pending migrations" in pending.stdout
    assert started.returncode == 0 and ops.by_hand, started.stdout + started.stderr
    ops.relay = None  # the one the playbook started runs from now on
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert "backlog drained" in drained.stdout
    assert ops.load is not None
    ops.load.paused.set()  # with producers quiet, the backlog is back to zero
    try:
        wait_until(lambda: ops.unsent() == 0, timeout=60)
    finally:
        ops.load.paused.clear()
    prom(ops).wait_resolved("PipelineRelayDown", RESOLVE_TIMEOUT)
    prom(ops).wait_resolved("PipelineTargetDown", RESOLVE_TIMEOUT)


def test_a_consumer_failing_every_attempt_fires_and_resolves(ops: Ops) -> None:
    ops.fail_flag.touch()
    try:
        alert = prom(ops).wait_firing(
            "PipelineConsumerFailureRatioHigh", FIRE_TIMEOUT, consumer="ledger"
        )
        assert "Consumer ledger failed" in alert["annotations"]["description"]
        assert alert["annotations"]["dashboard_url"].endswith("var-consumer=ledger")
        assert not prom(ops).firing("PipelineConsumerFailureRatioHigh", consumer="orders")
    finally:
        ops.fail_flag.unlink()
    prom(ops).wait_resolved("PipelineConsumerFailureRatioHigh", RESOLVE_TIMEOUT)


def queued(ops: Ops, queue: str) -> int:
    client = redis.Redis.from_url(ops.redis.url)
    try:
        return int(client.llen(f"{ops.settings.redis_namespace}:{queue}"))
    finally:
        client.close()


def test_redis_restart_fires_redis_unreachable_and_lost_deliveries_are_sent_again(
    ops: Ops,
) -> None:
    """Redis dies with deliveries on the queues (the worker is paused), comes back empty."""
    assert ops.worker is not None
    os.killpg(ops.worker.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: queued(ops, "pipeline.orders") > 5, timeout=30)
        ops.redis.kill()
        try:
            alert = prom(ops).wait_firing("PipelineRedisUnreachable", FIRE_TIMEOUT)
            assert alert["labels"]["severity"] == "critical"
            assert alert["labels"]["transport"] == "redis"
            assert not prom(ops).firing("PipelinePostgresUnreachable")
        finally:
            ops.redis.start()
    finally:
        os.killpg(ops.worker.pid, signal.SIGCONT)
    prom(ops).wait_resolved("PipelineRedisUnreachable", RESOLVE_TIMEOUT)
    # what Redis forgot, the ledger sweep sends again: re-deliveries spike, then nothing is owed.
    # The relay's canary consumer lost its deliveries too and may fire first: look for ours.
    spiking = wait_until(
        lambda: [
            alert
            for alert in prom(ops).firing("PipelineRedeliveriesSpiking")
            if alert["labels"]["consumer"] in {"orders", "ledger"}
        ],
        timeout=FIRE_TIMEOUT,
        interval=0.5,
    )
    assert spiking[0]["labels"]["severity"] == "warning"
    owed = "max(pipeline_deliveries_owed)"
    wait_until(lambda: float(prom(ops).query(owed)[0]["value"][1]) == 0, timeout=120)
    prom(ops).wait_resolved("PipelineRedeliveriesSpiking", RESOLVE_TIMEOUT)
    ops.check_processes()
    canary = "time() - max(pipeline_canary_last_success_timestamp_seconds)"
    wait_until(lambda: float(prom(ops).query(canary)[0]["value"][1]) < 10, timeout=120)


def test_events_sent_to_no_consumer_fire_the_unrouted_alert_for_their_type(ops: Ops) -> None:
    """An event type nobody subscribes to (not the one sent on purpose) fires the alert
    with its type, and it resolves once no more are sent."""
    with Session(ops.engine) as session, session.begin():
        add_events(session, [NewEvent("ledger.forgotten", {"n": i}) for i in range(3)])
    alert = prom(ops).wait_firing("PipelineEventsUnrouted", FIRE_TIMEOUT)
    assert alert["labels"]["event_type"] == "ledger.forgotten"
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["runbook_url"] == KIT.runbook("PipelineEventsUnrouted")
    assert "of type ledger.forgotten went to no consumer" in alert["annotations"]["description"]
    assert not prom(ops).firing("PipelineEventsUnrouted", event_type="audit.noted")
    prom(ops).wait_resolved("PipelineEventsUnrouted", RESOLVE_TIMEOUT)


# -- the poison-message playbook (needs `pipeline dlq`) ----------------------------------------


def dead_letter_of(ops: Ops, event_id: Any) -> tuple[str, Any] | None:
    with psycopg.connect(ops.settings.require_database_url()) as conn:
        row = conn.execute(
            "SELECT id, replayed_at FROM pipeline.dead_letters "
            "WHERE event_id = %s AND consumer = 'orders'",
            (event_id,),
        ).fetchone()
    return (str(row[0]), row[1]) if row else None


def effects_of(ops: Ops, event_id: Any) -> dict[str, int]:
    with ops.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT consumer, count(*) FROM ops_effects WHERE event_id = :e GROUP BY 1"),
            {"e": str(event_id)},
        ).all()
    return {consumer: int(count) for consumer, count in rows}


def test_poison_event_fires_dead_letters_and_the_playbook_replays_it_once(ops: Ops) -> None:
    ops.poison_flag.touch()
    with Session(ops.engine) as session, session.begin():
        [event_id] = add_events(session, [NewEvent("order.placed", {"poison": True})])
    alert = prom(ops).wait_firing("PipelineDeadLettersWaiting", FIRE_TIMEOUT, stage="consume")
    assert alert["annotations"]["description"].startswith("1 dead letters at the consume stage")
    found = wait_until(lambda: dead_letter_of(ops, event_id), timeout=30)
    dead_letter_id, replayed_at = found
    assert replayed_at is None
    assert effects_of(ops, event_id) == {"ledger": 1}  # the other consumer was not held up

    ops.poison_flag.unlink()  # the fix is deployed
    grouped = subprocess.run(
        ["bash", "-c", "pipeline dlq groups --stage consume --consumer orders --waiting --json"],
        check=True,
        cwd=ops.directory,
        env=ops.env(),
        capture_output=True,
        text=True,
    )
    [group] = json.loads(grouped.stdout)  # one poison event: one cause
    results = ops.run_steps(
        "poison-message",
        CONSUMER="orders",
        FINGERPRINT=group["fingerprint"],
        DEAD_LETTER_ID=dead_letter_id,
        EVENT_ID=str(event_id),
        INCIDENT="OPS-1",
    )

    failed = [(r.args, r.returncode, r.stdout, r.stderr) for r in results if r.returncode != 0]
    assert not failed, failed
    groups, listing, shown = results[0].stdout, results[1].stdout, results[2].stdout
    assert group["fingerprint"] in groups and "InvalidOrder" in groups
    assert dead_letter_id in listing and "InvalidOrder" in listing
    assert "order has no line items" in shown
    assert str(event_id) in results[3].stdout  # pipeline trace
    assert dead_letter_id in results[4].stdout  # the dry run names what it would replay
    wait_until(lambda: effects_of(ops, event_id) == {"ledger": 1, "orders": 1}, timeout=60)
    time.sleep(3)
    assert effects_of(ops, event_id) == {"ledger": 1, "orders": 1}  # processed once
    replayed = dead_letter_of(ops, event_id)
    assert replayed is not None and replayed[1] is not None
    prom(ops).wait_resolved("PipelineDeadLettersWaiting", RESOLVE_TIMEOUT)


# -- names ---------------------------------------------------------------------------------


def test_every_metric_the_kit_uses_was_scraped(ops: Ops) -> None:
    """Every metric a rule or panel names was scraped: declared by a target (Prometheus's
    metadata), and, after the load and the faults above, with samples, except the few that
    only count events no test here provokes."""
    used: set[str] = set()
    for rule in alert_rules() + recording_rules():
        used |= {family(n) for n in metric_names(rule["expr"]) if n != "up"}
    for query in panel_queries():
        used |= {family(n) for n in metric_names(query.expr) if n != "up"}
    assert len(used) >= 25
    sampled = {family(name) for name in prom(ops).metric_names()}
    declared = {family(name) for name in prom(ops).api("metadata")}
    assert used - (sampled | declared) == set()
    assert used - sampled <= {
        "pipeline_inbox_duplicates",  # a copy of a finished event delivered again
        "pipeline_inbox_infrastructure_retries",  # a worker's database connection died
    }
