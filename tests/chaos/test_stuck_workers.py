"""No one waits on a stuck worker: real relay and worker processes against real servers.

* A worker group frozen (``SIGSTOP``) with an inbox transaction open, whose handler has
  published a follow-up event of a key the producers write: the producers keep
  committing, the other worker group keeps processing, and after ``SIGCONT`` nothing is
  lost, nothing happens twice and every key is handled in order.
* Postgres refusing the workers' connections for 20 s: the worker log has one line per
  failed message (error class, actor, message id, next retry) and no traceback.

Rates are printed (``-s``) for the report, never asserted.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from pipeline import NewEvent, Settings, add_event
from tests.chaos.orders import fault_settings
from tests.support import (
    freeze_group,
    log_size,
    produce,
    soak,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.stuck_app"
HOLD_LOCK = 4242  # tests/apps/stuck_app.py: the holder waits for this advisory lock
KEYS = [f"acct:{n}" for n in range(16)]
HOT_KEY = KEYS[0]
TABLES = """
CREATE TABLE tally (id bigserial PRIMARY KEY, consumer text NOT NULL, event_id uuid NOT NULL,
                    ordering_key text, seq bigint NOT NULL);
"""


@pytest.fixture
def stuck_settings(settings: Settings, engine) -> Iterator[Settings]:
    with fault_settings(settings, engine, TABLES) as value:
        yield value


def scalar(engine: Engine, sql: str, **params: object):
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


class Producers:
    """Application threads, each committing one ``order.placed`` per transaction, round
    robin over ``KEYS`` (so each soon writes the hot key); commit times are kept."""

    def __init__(self, engine: Engine, threads: int = 3, event_type: str = "order.placed") -> None:
        self.engine = engine
        self.event_type = event_type
        self.stop = threading.Event()
        self.commits: list[float] = []
        self.hot: list[float] = []  # commits of events of the hot key
        self.ids: list[uuid.UUID] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)
        ]

    def _run(self, number: int) -> None:
        count = 0
        while not self.stop.is_set():
            key = KEYS[(number + count) % len(KEYS)]
            count += 1
            try:
                with Session(self.engine) as session, session.begin():
                    event_id = add_event(
                        session,
                        self.event_type,
                        {"n": count},
                        ordering_key=key if self.event_type == "order.placed" else None,
                    )
            except Exception as exc:  # reported by the test
                self.errors.append(exc)
                return
            with self._lock:
                self.commits.append(time.monotonic())
                self.ids.append(event_id)
                if key == HOT_KEY:
                    self.hot.append(time.monotonic())
            time.sleep(0.05)  # an offered rate of up to ~20 orders/s per thread

    def __enter__(self) -> Producers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def committed(self) -> int:
        with self._lock:
            return len(self.commits)

    def hot_commits(self, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for t in self.hot if start <= t < end)

    def rate(self, start: float, end: float) -> float:
        with self._lock:
            inside = sum(1 for t in self.commits if start <= t < end)
        return inside / (end - start)


def assert_each_once_in_key_order(engine: Engine, ids: list[uuid.UUID]) -> None:
    """Every produced event handled once; the ordered consumer's keys in sequence order."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT consumer, event_id, ordering_key, seq FROM tally ORDER BY id")
        ).all()
    counts = Counter((row[0], row[1]) for row in rows)
    assert not [i for i, n in counts.items() if n > 1], "an event took effect twice"
    assert not set(ids) - {event_id for _, event_id in counts}, "an event was lost"
    last: dict[str, int] = {}
    for consumer, _, key, seq in rows:
        if consumer == "tally":
            assert seq > last.get(key, 0), f"{key}: seq {seq} handled after {last[key]}"
            last[key] = seq
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0


def tallied(engine: Engine) -> int:
    return scalar(engine, "SELECT count(*) FROM tally")


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_frozen_worker_group_stops_no_producer_and_no_other_worker(
    engine, stuck_settings, tmp_path
):
    """Group A's handler published a follow-up of the hot key and waits inside its inbox
    transaction; A is then stopped for the pause. Producers (every thread writes the hot
    key) keep committing, group B keeps processing; after SIGCONT all invariants hold."""
    pause = soak(12, 45)
    pid_file = tmp_path / "holder.pid"
    env = {"TEST_HOLD_PID_FILE": str(pid_file)}
    relay = start_relay(stuck_settings, APP, tmp_path / "relay.log")
    groups = [
        start_worker(stuck_settings, APP, tmp_path / f"worker-{name}.log", 1, 4, **env)
        for name in "ab"
    ]
    stopped: list[int] = []
    hold = engine.connect()
    try:
        with Producers(engine) as producers:
            wait_until(
                lambda: tallied(engine) >= 100,
                timeout=60,
                progress=lambda: tallied(engine),
                alive=[relay, *groups],
            )
            hold.execute(text("SELECT pg_advisory_lock(:k)"), {"k": HOLD_LOCK})
            produce(engine, [NewEvent("hold.start", {"key": HOT_KEY})])
            wait_until(
                lambda: (
                    scalar(
                        engine,
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                        " AND objid = :k",
                        k=HOLD_LOCK,
                    )
                    == 1
                    and pid_file.exists()
                    and pid_file.read_text() != ""
                ),
                timeout=60,
                alive=[relay, *groups],
            )
            group = os.getpgid(int(pid_file.read_text()))
            (frozen,) = [g for g in groups if g.pid == group]
            (healthy,) = [g for g in groups if g.pid != group]
            before_end = time.monotonic()
            before = producers.rate(before_end - 5, before_end)
            stopped.append(group)
            # every thread stopped before the lock is released: a thread still running
            # would take it and commit (or stop between its follow-up's insert and COMMIT)
            freeze_group(group)
            hold.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": HOLD_LOCK})
            hold.commit()
            # the frozen handler's backend takes the lock and waits for its client,
            # its transaction open: the state the pause is about
            wait_until(
                lambda: (
                    scalar(
                        engine,
                        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
                        " AND query LIKE '%pg_advisory_xact_lock%'",
                    )
                    == 1
                ),
                timeout=30,
            )
            pause_start = time.monotonic()
            committed_at_pause, tallied_at_pause = producers.committed(), tallied(engine)
            time.sleep(pause)
            pause_end = time.monotonic()
            committed_in_pause = producers.committed() - committed_at_pause
            tallied_in_pause = tallied(engine) - tallied_at_pause
            during = producers.rate(pause_start, pause_end)
            last_seq = scalar(engine, "SELECT max(seq) FROM pipeline.outbox")
            hot_in_pause = producers.hot_commits(pause_start, pause_end)
            os.killpg(group, signal.SIGCONT)
            stopped.clear()
        assert not producers.errors, producers.errors
        print(
            f"\nproducers: {before:.1f} commits/s before the pause, {during:.1f} during "
            f"the {pause} s pause ({committed_in_pause} commits, {hot_in_pause} of the hot "
            "key); healthy group handled "
            f"{tallied_in_pause} events in the pause"
        )
        assert committed_in_pause > 0, "producers waited on the frozen worker"
        # the frozen handler published an event of the hot key: before its COMMIT, no
        # producer of that key could commit while it held the key's lock
        assert hot_in_pause > 0, "producers of the hot key waited on the frozen worker"
        assert tallied_in_pause > 0, "the healthy worker group sat idle"
        expected = len(producers.ids) + 2  # the hold event and its follow-up
        wait_until(
            lambda: tallied(engine) >= expected,
            timeout=120,
            interval=0.5,
            progress=lambda: tallied(engine),
            alive=[relay, frozen, healthy],
        )
        time.sleep(1.0)  # any late duplicate would show now
    finally:
        for group in stopped:
            os.killpg(group, signal.SIGCONT)
        hold.close()
        for process in groups:
            stop_process(process)
        stop_process(relay)
    assert_each_once_in_key_order(engine, producers.ids)
    assert tallied(engine) == expected
    # the frozen handler's follow-up was inserted when its transaction committed, after
    # SIGCONT: behind every event the producers committed during the pause
    follow_up = scalar(engine, "SELECT seq FROM pipeline.outbox WHERE event_type = 'order.noted'")
    assert follow_up > last_seq
    assert scalar(engine, "SELECT count(*) FROM tally WHERE ordering_key = :k", k=HOT_KEY) > 0


FAILURE = "message failed outside its handlers; it will be retried"
FIELD = re.compile(r"(\w+)=(\S+)")


def worker_role(engine: Engine, database_url: str) -> tuple[str, str]:
    """A login role with every grant the worker needs on this database; (name, URL)."""
    role = f"pipeline_w_{uuid.uuid4().hex[:8]}"
    dbname = database_url.rsplit("/", 1)[1].split("?", maxsplit=1)[0]
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for statement in (
            f"CREATE ROLE {role} LOGIN",
            f'GRANT CONNECT ON DATABASE "{dbname}" TO {role}',
            f"GRANT USAGE ON SCHEMA pipeline, public TO {role}",
            f"GRANT ALL ON ALL TABLES IN SCHEMA pipeline, public TO {role}",
            f"GRANT ALL ON ALL SEQUENCES IN SCHEMA pipeline, public TO {role}",
        ):
            conn.exec_driver_sql(statement)
    return role, re.sub(r"//[^@/]*@", f"//{role}@", database_url, count=1)


def drop_role(engine: Engine, role: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"ALTER ROLE {role} CONNECTION LIMIT -1")
        conn.exec_driver_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %(r)s",
            {"r": role},
        )
        conn.exec_driver_sql(f"DROP OWNED BY {role}")
        conn.exec_driver_sql(f"DROP ROLE {role}")


def outage_logged(failures: list[dict[str, str]], count: int) -> bool:
    """At least ``count`` failures logged, and some message's second retry among them."""
    by_message = Counter(fields.get("message_id") for fields in failures)
    return len(failures) >= count and max(by_message.values(), default=0) >= 3


def failure_lines(log: Path, since: int) -> list[dict[str, str]]:
    content = log.read_bytes()[since:].decode(errors="replace")
    return [dict(FIELD.findall(line)) for line in content.splitlines() if FAILURE in line]


@pytest.mark.timeout(600)
def test_worker_log_has_one_line_per_failure_while_postgres_refuses_connections(
    engine, stuck_settings, tmp_path
):
    """The workers' role is refused every connection (``too many connections``) and its
    sessions are terminated until twenty failures, a second retry among them, are logged, while
    events keep arriving: one warning per failed message with its error class, actor,
    message id and next retry; no traceback, no error line of Dramatiq's; and every event
    is handled once afterwards."""
    role, url = worker_role(engine, stuck_settings.require_database_url())
    worker_log = tmp_path / "worker.log"
    relay = start_relay(stuck_settings, APP, tmp_path / "relay.log")
    workers = start_worker(stuck_settings.replace(database_url=url), APP, worker_log, 1, 4)
    try:
        with Producers(engine, event_type="item.added") as producers:
            wait_until(
                lambda: tallied(engine) >= 50,
                timeout=60,
                progress=lambda: tallied(engine),
                alive=[relay, workers],
            )
            mark = log_size(worker_log)
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql(f"ALTER ROLE {role} CONNECTION LIMIT 0")
                conn.exec_driver_sql(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %(r)s",
                    {"r": role},
                )
            began = time.monotonic()
            # The outage lasts until the log shows twenty failures, one message failing on
            # its second retry among them
            wait_until(
                lambda: outage_logged(failure_lines(worker_log, mark), 20),
                timeout=120,
                interval=0.5,
                alive=[relay, workers],
            )
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql(f"ALTER ROLE {role} CONNECTION LIMIT -1")
            restored = time.monotonic()
            lasted = restored - began
            outage = log_size(worker_log) - mark
        assert not producers.errors, producers.errors
        wait_until(
            lambda: tallied(engine) >= len(producers.ids),
            timeout=120,
            interval=0.5,
            progress=lambda: tallied(engine),
            alive=[relay, workers],
        )
        recovered = time.monotonic() - restored
        time.sleep(1.0)
    finally:
        stop_process(workers)
        stop_process(relay)
        drop_role(engine, role)
    assert_each_once_in_key_order(engine, producers.ids)
    content = worker_log.read_text(errors="replace")
    assert "Traceback" not in content, content[-4000:]
    assert "Failed to process message" not in content
    assert "Retrying message" not in content  # Dramatiq's own line is DEBUG: ours says it
    failures = failure_lines(worker_log, mark)
    outage_lines = worker_log.read_bytes()[mark : mark + outage].decode(errors="replace")
    print(
        f"\nworker log during the {lasted:.1f} s outage: {len(outage_lines.splitlines())} lines, "
        f"{len(failures)} failure lines in all; every event handled {recovered:.1f} s "
        "after the connections were allowed again"
    )
    assert failures, "no failure was logged"
    for fields in failures:
        assert fields.keys() >= {"actor", "message_id", "error_class", "retry_in", "retries"}
        assert fields["actor"].startswith("pipeline_inbox_")
    assert {f["error_class"] for f in failures} == {"OperationalError"}
    tries = Counter((f["message_id"], f["retries"]) for f in failures)
    assert max(tries.values()) == 1, "a failure was logged twice"
