"""Processes that stop without dying (SIGSTOP) never stop the others.

A relay stopped between its sent mark and its COMMIT holds the sent events' row locks
for as long as it is stopped. Once its lease expired, another relay's claim used to
wait on those locks while holding the lock that serialises claims: nothing was
published until the stopped relay resumed. Claims now skip the rows another session
holds (and the rest of those keys' runs), so the other relay goes on publishing.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
from sqlalchemy import text

from pipeline import NewEvent, Settings
from pipeline.observability.metrics import REDELIVERY_REASONS
from pipeline.testhooks import PAUSE_BEFORE_COMMIT
from pipeline.tools.drill.proxy import ProxyProcess
from pipeline.tools.harness.fleet import Fleet
from pipeline.transport.redis.keys import acks_key, messages_key
from tests.support import (
    QUICK_FAULTS,
    SOAK,
    installed_settings,
    produce,
    soak,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.pause_app"
TABLE = """
CREATE TABLE pause_effects (id bigserial PRIMARY KEY, event_id uuid NOT NULL,
                            ordering_key text, seq bigint NOT NULL);
"""
CLAIM_LOCK = "pipeline.claim.pipeline"  # the advisory lock claims take (functions.sql)
KEYS = 500  # many keys: a stopped relay's batch holds back only a few of them


@pytest.fixture
def pause_settings(settings: Settings, engine) -> Iterator[Settings]:
    with installed_settings(
        settings,
        engine,
        TABLE,
        **{
            **QUICK_FAULTS,
            "lease_seconds": 2.0,
            "batch_size": 20,
            "max_events_per_message": 10,
            "poll_interval_max": 0.2,
            "broker_heartbeat_timeout_ms": 5000,
        },
    ) as value:
        yield value


def scalar(engine, query: str, **params: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(query), params).scalar_one())


def sent_count(engine) -> int:
    return scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'")


def stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


class Producer(threading.Thread):
    """Commits events of ``KEYS`` keys in small transactions until stopped, at ``rate``
    events a second (paced) or as fast as it can with ``pause`` between transactions."""

    def __init__(
        self, engine, per_transaction: int = 5, pause: float = 0.02, rate: float | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.per_transaction = per_transaction
        self.pause = pause
        self.rate = rate
        self.halt = threading.Event()
        self.ids: list = []
        self.error: BaseException | None = None

    def run(self) -> None:
        n = 0
        start = time.monotonic()
        try:
            while not self.halt.is_set():
                events = [
                    NewEvent("order.placed", {"i": i}, aggregate_id=str(i % KEYS))
                    for i in range(n, n + self.per_transaction)
                ]
                n += self.per_transaction
                self.ids += produce(self.engine, events, per_transaction=self.per_transaction)
                if self.rate is None:
                    time.sleep(self.pause)
                else:  # the next transaction's slot
                    self.halt.wait(max(0.0, start + n / self.rate - time.monotonic()))
        except BaseException as exc:  # reported by the test
            self.error = exc


def rates(engine, producer: Producer, seconds: float) -> tuple[float, float]:
    """Events marked sent and events committed per second over the next ``seconds``
    (measured and reported, not asserted)."""
    sent, made, start = sent_count(engine), len(producer.ids), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return (sent_count(engine) - sent) / elapsed, (len(producer.ids) - made) / elapsed


def assert_effects_once_in_key_order(engine, ids: list) -> None:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT event_id, ordering_key, seq FROM pause_effects ORDER BY id")
        ).all()
    counts: dict = defaultdict(int)
    last: dict[str, int] = {}
    for event_id, key, seq in rows:
        counts[event_id] += 1
        assert seq > last.get(key, -1), f"key {key}: seq {seq} ran after {last[key]}"
        last[key] = seq
    assert set(counts) == set(ids), "an event's handler never ran"
    assert max(counts.values()) == 1, "a handler ran twice for one event"


def test_a_relay_stopped_before_its_commit_does_not_stop_the_other(
    engine, pause_settings, tmp_path
):
    trigger = tmp_path / "pause-now"
    paused = start_relay(
        pause_settings,
        APP,
        tmp_path / "paused.log",
        "--mode",
        "inline",
        PIPELINE_METRICS_PORT="0",
        **{PAUSE_BEFORE_COMMIT: str(trigger)},
    )
    other = start_relay(
        pause_settings, APP, tmp_path / "other.log", "--mode", "inline", PIPELINE_METRICS_PORT="0"
    )
    worker = start_worker(pause_settings, APP, tmp_path / "worker.log", threads=4)
    producer = Producer(engine)
    producer.start()
    resumed = False
    try:
        wait_until(lambda: sent_count(engine) > 200, timeout=60, alive=[paused, other, worker])
        wait_until(  # caught up with the producer: the rate before is the steady one
            lambda: len(producer.ids) - sent_count(engine) < 50,
            timeout=60,
            alive=[paused, other, worker],
        )
        sent_before, made_before = rates(engine, producer, 3.0)

        trigger.touch()  # the paused relay stops itself after its next sent mark
        wait_until(lambda: stopped(paused.pid), timeout=60, alive=[other, worker])
        held = scalar(
            engine,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'active' AND wait_event = 'ClientRead'",
        )
        # Its claimed events' leases expire while it is stopped: from then on the other
        # relay's claims meet the rows it holds.
        wait_until(
            lambda: (
                scalar(
                    engine,
                    "SELECT count(*) FROM pipeline.outbox WHERE status = 'publishing' "
                    "AND lease_owner LIKE :owner AND lease_expires_at < clock_timestamp()",
                    owner=f"%-{paused.pid}-%",
                )
                > 0
            ),
            timeout=60,
            alive=[other, worker],
        )
        expired_at = sent_count(engine)
        # Publishing goes on: the other relay marks events sent while this one is stopped.
        wait_until(
            lambda: sent_count(engine) > expired_at + 300,
            timeout=120,
            progress=lambda: sent_count(engine),
            alive=[other, worker],
        )
        sent_paused, made_paused = rates(engine, producer, 3.0)
        assert stopped(paused.pid), "the relay resumed before the measurement ended"
        print(
            f"before the pause: {sent_before:.0f} sent/s, {made_before:.0f} committed/s; "
            f"during it, after the lease expired: {sent_paused:.0f} sent/s, "
            f"{made_paused:.0f} committed/s; sessions active in ClientRead: {held}"
        )
        os.kill(paused.pid, signal.SIGCONT)
        resumed = True
        producer.halt.set()
        producer.join(30)
        assert producer.error is None, producer.error
        total = len(producer.ids)
        wait_until(
            lambda: sent_count(engine) == total,
            timeout=120,
            progress=lambda: sent_count(engine),
            alive=[paused, other, worker],
        )
        wait_until(
            lambda: scalar(engine, "SELECT count(DISTINCT event_id) FROM pause_effects") == total,
            timeout=120,
            progress=lambda: scalar(engine, "SELECT count(*) FROM pause_effects"),
            alive=[paused, other, worker],
        )
    finally:
        producer.halt.set()
        if not resumed and paused.poll() is None:
            os.kill(paused.pid, signal.SIGCONT)
        for process in (worker, other, paused):
            stop_process(process)
    assert_effects_once_in_key_order(engine, producer.ids)
    assert [p.returncode for p in (paused, other, worker)] == [0, 0, 0]
    for log in ("paused.log", "other.log"):
        assert "Traceback" not in (tmp_path / log).read_text(), log


def metric_samples(port: int, name: str) -> dict[str, float]:
    """A metric's samples on a process's /metrics endpoint, by their label text ({} while
    the endpoint does not answer)."""
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.TransportError:  # not listening yet
        return {}
    return {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith(name + "{")
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.skipif(not SOAK, reason="a slow consumer for a minute; PIPELINE_SOAK=1 runs it")
def test_a_consumer_that_is_merely_slow_gets_no_copies_of_its_backlog(
    engine, pause_settings, tmp_path
):
    """Handlers sleep 200 ms, events arrive at 100/s (a minute with PIPELINE_SOAK=1): the
    consumer falls behind by thousands of events, all overdue past a short horizon, and
    all in flight (queued, prefetched or running). The ledger sends none of them again."""
    settings = pause_settings.replace(
        redelivery_horizon_seconds=3.0, reconcile_interval_seconds=1.0, batch_size=200
    )
    port = free_port()
    relay = start_relay(
        settings, APP, tmp_path / "relay.log", "--mode", "inline", PIPELINE_METRICS_PORT=str(port)
    )
    worker = start_worker(
        settings, APP, tmp_path / "worker.log", threads=8, TEST_HANDLER_SLEEP="0.2"
    )
    producer = Producer(engine, per_transaction=5, rate=100.0)
    seconds = soak(15, 60)
    try:
        wait_until(
            lambda: metric_samples(port, "pipeline_ledger_redeliveries_total"),
            timeout=60,
            alive=[relay, worker],
        )
        zero = metric_samples(port, "pipeline_ledger_redeliveries_total")
        producer.start()
        time.sleep(seconds)  # the offered load's duration, not an assertion
        producer.halt.set()
        producer.join(30)
        assert producer.error is None, producer.error
        total = len(producer.ids)
        behind = total - scalar(engine, "SELECT count(*) FROM pause_effects")
        wait_until(
            lambda: scalar(engine, "SELECT count(DISTINCT event_id) FROM pause_effects") == total,
            timeout=600,
            progress=lambda: scalar(engine, "SELECT count(*) FROM pause_effects"),
            alive=[relay, worker],
        )
        resent = metric_samples(port, "pipeline_ledger_redeliveries_total")
        logged = scalar(
            engine, "SELECT count(*) FROM pipeline.delivery_log WHERE kind = 'redelivery'"
        )
    finally:
        producer.halt.set()
        for process in (worker, relay):
            stop_process(process)
    print(
        f"{total} events in {seconds}s; behind when production stopped: {behind}; "
        f"re-sent: {logged}; counter: {resent}"
    )
    assert {f'consumer="effects",reason="{r}"' for r in REDELIVERY_REASONS} <= set(zero)
    assert set(zero.values()) == {0.0}, zero
    assert behind > 0, "the consumer kept up: nothing was in flight long enough to test"
    assert logged == 0
    assert sum(resent.values()) == 0, resent
    assert_effects_once_in_key_order(engine, producer.ids)


def test_a_claim_that_gives_up_waiting_is_retried_with_one_line(engine, pause_settings, tmp_path):
    """A lock held past PIPELINE_LOCK_TIMEOUT_MS (here the claims' own lock, held by the
    test) makes the relay's claim give up: one line, no traceback, and it publishes once
    the lock is free."""
    log = tmp_path / "relay.log"
    relay = start_relay(
        pause_settings,
        APP,
        log,
        "--mode",
        "inline",
        PIPELINE_METRICS_PORT="0",
        PIPELINE_LOCK_TIMEOUT_MS="200",
    )
    try:
        wait_until(lambda: "relay started" in log.read_text(), timeout=60, alive=[relay])
        with engine.connect() as holder, holder.begin():
            holder.execute(
                text("SELECT pg_advisory_xact_lock(hashtext('pipeline.claim.pipeline'))")
            )
            ids = produce(engine, [NewEvent("order.placed", {"i": 1}, aggregate_id="1")])
            wait_until(lambda: "gave up waiting" in log.read_text(), timeout=60, alive=[relay])
            assert sent_count(engine) == 0
        wait_until(lambda: sent_count(engine) == 1, timeout=60, alive=[relay])
    finally:
        stop_process(relay)
    text_ = log.read_text()
    assert relay.returncode == 0
    assert "Traceback" not in text_
    lines = [line for line in text_.splitlines() if "gave up waiting" in line]
    assert lines and all("PIPELINE_LOCK_TIMEOUT_MS" in line for line in lines), lines
    assert scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'") == len(ids)


def test_an_acknowledgement_that_times_out_is_tried_again_not_left_behind(
    pause_settings: Settings, engine, tmp_path
):
    """The worker's link to Redis stalls while its handler runs, so the acknowledgement's
    read times out (a slow or lossy link, a Sentinel master mid-failover). The worker tries
    the acknowledgement again until Redis answers: the message does not stay in the live
    worker's un-acked set, where the delivery ledger would count it in flight for the life
    of the process and hold back every re-send on its queue."""
    redis_url = pause_settings.require_redis_url()
    target = urlsplit(redis_url)
    fleet = Fleet()
    relay = worker = None
    log = tmp_path / "worker.log"
    client = redis.Redis.from_url(redis_url)
    try:
        with (tmp_path / "proxy.log").open("ab") as proxy_log:
            proxy = ProxyProcess.start(
                fleet, target.hostname or "127.0.0.1", target.port or 6379, proxy_log
            )
        through = urlunsplit(
            target._replace(netloc=f"127.0.0.1:{proxy.port}", query="socket_timeout=1")
        )
        relay = start_relay(pause_settings, APP, tmp_path / "relay.log")
        worker = start_worker(
            pause_settings.replace(redis_url=through), APP, log, TEST_HANDLER_SLEEP="2"
        )
        namespace, queue = pause_settings.redis_namespace, "pipeline.effects"
        produce(engine, [NewEvent("order.placed", {"n": 1}, ordering_key="k")])

        def unacked() -> int:
            keys = client.scan_iter(match=acks_key(namespace, "*", queue), count=1000)
            return sum(client.scard(key) for key in keys)

        wait_until(lambda: unacked() == 1, timeout=60, alive=[relay, worker])  # in hand
        assert proxy.command("stall 6").startswith("stalled")  # the handler ends meanwhile
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM pause_effects") == 1, timeout=30)
        # acknowledged once Redis answers again: nothing left un-acked or stored
        wait_until(
            lambda: unacked() == 0 and client.hlen(messages_key(namespace, queue)) == 0,
            timeout=60,
            alive=[relay, worker],
        )
        content = log.read_text(errors="replace")
        assert "Unhandled error during post_process_message" not in content, content[-3000:]
        assert "due to a connection error" in content  # Dramatiq's own retry line
        assert scalar(engine, "SELECT count(*) FROM pause_effects") == 1
    finally:
        for process in (worker, relay):
            if process is not None:
                stop_process(process)
        client.close()
        fleet.close()
