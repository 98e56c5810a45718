"""Retention: what `pipeline prune` and the relay's janitor delete, and everything they never do.

Rows are seeded directly with their ages (older or younger than the retention) and every
never-delete case, then pruned; the assertions name exactly which rows remain.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import psycopg
import pytest

from pipeline.config import Settings
from pipeline.db.retention import TABLES, Pruner, RetentionPolicy
from pipeline.policy import ConsumerPolicy, retention_problems
from tests.support import (
    Ran,
    cli_argv,
    pipeline_env,
    run_cli,
    start_process,
    stop_process,
    wait_until,
)

OLD = 2000.0  # seconds ago: past every retention below
YOUNG = 100.0  # seconds ago: inside every retention
RETENTION = 1000
SLOW_APP = "tests.apps.slow_retry_app"  # consumer slowpoke: 10 retries, up to 3600 s apart


@pytest.fixture
def retention_settings(settings: Settings) -> Settings:
    return settings.replace(
        sent_retention_seconds=RETENTION,
        inbox_retention_seconds=RETENTION,
        attempts_retention_seconds=RETENTION,
        audit_retention_seconds=RETENTION,
        prune_batch_size=2,  # several batches per table: the keyset walk is exercised
    )


@dataclass
class Seeded:
    """Ids of the seeded rows by what the prune must do with them."""

    outbox_gone: set[uuid.UUID] = field(default_factory=set)
    outbox_kept: set[uuid.UUID] = field(default_factory=set)
    inbox_gone: set[tuple[str, uuid.UUID]] = field(default_factory=set)
    inbox_kept: set[tuple[str, uuid.UUID]] = field(default_factory=set)
    attempts_gone: set[str] = field(default_factory=set)  # by error text
    attempts_kept: set[str] = field(default_factory=set)
    log_gone: set[uuid.UUID] = field(default_factory=set)
    log_kept: set[uuid.UUID] = field(default_factory=set)
    audit_gone: set[str] = field(default_factory=set)  # by action
    audit_kept: set[str] = field(default_factory=set)
    dead_letters: int = 0


class Seeder:
    def __init__(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        self.conn = conn
        self.seeded = Seeded()

    def outbox(
        self, status: str, age: float, consumers: list[str] | None, *, gone: bool
    ) -> uuid.UUID:
        event_id = uuid.uuid4()
        self.conn.execute(
            "INSERT INTO pipeline.outbox (id, event_type, payload, status, created_at, "
            "published_at, consumers) VALUES (%s, 'order.placed', '{}', %s, "
            "now() - make_interval(secs => %s), "
            "CASE WHEN %s = 'sent' THEN now() - make_interval(secs => %s) END, %s)",
            (event_id, status, age + 1, status, age, consumers),
        )
        (self.seeded.outbox_gone if gone else self.seeded.outbox_kept).add(event_id)
        return event_id

    def inbox(
        self, consumer: str, event_id: uuid.UUID, status: str, age: float, *, gone: bool
    ) -> None:
        self.conn.execute(
            "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status, processed_at, "
            "received_at) VALUES (%s, %s, 'order.placed', %s, "
            "CASE WHEN %s = 'processed' THEN now() - make_interval(secs => %s) END, "
            "now() - make_interval(secs => %s))",
            (consumer, event_id, status, status, age, age + 1),
        )
        (self.seeded.inbox_gone if gone else self.seeded.inbox_kept).add((consumer, event_id))

    def attempt(self, event_id: uuid.UUID, age: float, *, gone: bool) -> None:
        label = f"attempt-{uuid.uuid4().hex[:8]}"
        self.conn.execute(
            "INSERT INTO pipeline.attempts (event_id, stage, consumer, attempt, error_class, "
            "error, occurred_at) VALUES (%s, 'consume', 'a', 1, 'Boom', %s, "
            "now() - make_interval(secs => %s))",
            (event_id, label, age),
        )
        (self.seeded.attempts_gone if gone else self.seeded.attempts_kept).add(label)

    def dead_letter(self, event_id: uuid.UUID, age: float) -> None:
        self.conn.execute(
            "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, reason, error_class, "
            "error, created_at) VALUES ('consume', %s, 'b', 'gave up', 'Boom', 'boom', "
            "now() - make_interval(secs => %s))",
            (event_id, age),
        )
        self.seeded.dead_letters += 1

    def log(self, age: float, *, gone: bool) -> None:
        event_id = uuid.uuid4()
        self.conn.execute(
            "INSERT INTO pipeline.delivery_log (consumer, event_id, kind, at) "
            "VALUES ('a', %s, 'duplicate', now() - make_interval(secs => %s))",
            (event_id, age),
        )
        (self.seeded.log_gone if gone else self.seeded.log_kept).add(event_id)

    def audit(self, age: float, *, gone: bool) -> None:
        action = f"action-{uuid.uuid4().hex[:8]}"
        self.conn.execute(
            "INSERT INTO pipeline.audit_log (actor, action, at) "
            "VALUES ('tester', %s, now() - make_interval(secs => %s))",
            (action, age),
        )
        (self.seeded.audit_gone if gone else self.seeded.audit_kept).add(action)


def seed(url: str) -> Seeded:
    """Every kind of row, older and younger than its retention, and every never-delete case."""
    with psycopg.connect(url, autocommit=True) as conn:
        s = Seeder(conn)
        # Sent, old, every consumer has an outcome (processed, dead): the event goes, then
        # its processed inbox row (the event has left the outbox); the dead row stays.
        done = s.outbox("sent", OLD, ["a", "b"], gone=True)
        s.inbox("a", done, "processed", OLD, gone=True)
        s.inbox("b", done, "dead", OLD, gone=False)
        # Sent, old, to no consumer at all (or before consumers were recorded): goes.
        s.outbox("sent", OLD, [], gone=True)
        s.outbox("sent", OLD, None, gone=True)
        # Sent and processed, but younger than the retention: stays.
        young = s.outbox("sent", YOUNG, ["a"], gone=False)
        s.inbox("a", young, "processed", YOUNG, gone=False)
        # Never sent, however old: pending, publishing, dead (publish stage).
        for status in ("pending", "publishing", "dead"):
            s.outbox(status, OLD, None, gone=False)
        # Sent but still owed: a consumer without an inbox row, or with a pending or
        # failed one. The event stays, and so do the other consumers' processed rows.
        missing = s.outbox("sent", OLD, ["a", "b"], gone=False)
        s.inbox("a", missing, "processed", OLD, gone=False)
        for status in ("pending", "failed"):
            owed = s.outbox("sent", OLD, ["a"], gone=False)
            s.inbox("a", owed, status, OLD, gone=False)
        # Sent and finished, but a dead letter refers to it (a replay needs the event):
        # stays, as do its attempts, whatever their age, and the dead letter itself.
        lettered = s.outbox("sent", OLD, ["a", "b"], gone=False)
        s.inbox("a", lettered, "processed", OLD, gone=False)
        s.inbox("b", lettered, "dead", OLD, gone=False)
        s.dead_letter(lettered, OLD)
        s.attempt(lettered, OLD, gone=False)
        # Inbox rows whose event left the outbox long ago: processed ones past the
        # retention go; young ones and pending, failed or dead ones stay.
        s.inbox("a", uuid.uuid4(), "processed", OLD, gone=True)
        s.inbox("b", uuid.uuid4(), "processed", OLD, gone=True)
        s.inbox("a", uuid.uuid4(), "processed", YOUNG, gone=False)
        for status in ("pending", "failed", "dead"):
            s.inbox("a", uuid.uuid4(), status, OLD, gone=False)
        # Attempt history, delivery log and audit records: by age.
        for _ in range(3):
            s.attempt(uuid.uuid4(), OLD, gone=True)
        s.attempt(uuid.uuid4(), YOUNG, gone=False)
        for _ in range(3):
            s.log(OLD, gone=True)
        s.log(YOUNG, gone=False)
        for _ in range(3):
            s.audit(OLD, gone=True)
        s.audit(YOUNG, gone=False)
        s.dead_letter(uuid.uuid4(), OLD)  # dead letters are never pruned
    return s.seeded


def remaining(url: str) -> dict[str, set[object]]:
    with psycopg.connect(url) as conn:
        return {
            "outbox": {r[0] for r in conn.execute("SELECT id FROM pipeline.outbox")},
            "inbox": {
                (r[0], r[1]) for r in conn.execute("SELECT consumer, event_id FROM pipeline.inbox")
            },
            "attempts": {r[0] for r in conn.execute("SELECT error FROM pipeline.attempts")},
            "log": {r[0] for r in conn.execute("SELECT event_id FROM pipeline.delivery_log")},
            "audit": {
                r[0]
                for r in conn.execute(
                    "SELECT action FROM pipeline.audit_log WHERE action <> 'prune'"
                )
            },
            "dead_letters": {r[0] for r in conn.execute("SELECT id FROM pipeline.dead_letters")},
        }


def checksums(url: str) -> dict[str, str]:
    """One digest of every row of every pipeline table."""
    with psycopg.connect(url) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'pipeline' ORDER BY 1"
            )
        ]
        return {
            table: str(
                conn.execute(
                    f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
                    f"FROM pipeline.{table} t"
                ).fetchone()[0]
            )
            for table in tables
        }


def assert_pruned(url: str, seeded: Seeded) -> None:
    left = remaining(url)
    assert left["outbox"] == seeded.outbox_kept
    assert left["inbox"] == seeded.inbox_kept
    assert left["attempts"] == seeded.attempts_kept
    assert left["log"] == seeded.log_kept
    assert left["audit"] == seeded.audit_kept
    assert len(left["dead_letters"]) == seeded.dead_letters


def test_prune_deletes_exactly_the_expired_rows_and_nothing_still_needed(retention_settings):
    url = retention_settings.require_database_url()
    seeded = seed(url)
    batches: list[tuple[str, int]] = []
    pruner = Pruner(
        "pipeline",
        RetentionPolicy.from_settings(retention_settings),
        on_batch=lambda table, n: batches.append((table, n)),
    )
    with psycopg.connect(url, autocommit=True) as conn:
        result = pruner.run(conn)
    assert_pruned(url, seeded)
    by_table = {t.table: t for t in result.tables}
    assert [t.table for t in result.tables] == list(TABLES)
    assert by_table["outbox"].deleted == len(seeded.outbox_gone) == 3
    # old sent events kept: owed (3), dead-lettered (1)
    assert by_table["outbox"].kept == 4
    assert by_table["inbox"].deleted == len(seeded.inbox_gone) == 3
    # old processed rows kept because their event is still in the outbox
    assert by_table["inbox"].kept == 2
    assert by_table["attempts"].deleted == 3 and by_table["attempts"].kept == 1
    assert by_table["delivery_log"].deleted == 3
    assert by_table["audit_log"].deleted == 3
    assert by_table["outbox"].batches >= 4  # batches of 2 rows
    assert all(t.complete for t in result.tables)
    assert sum(n for table, n in batches if table == "inbox") == 3
    # A second pass finds nothing more.
    with psycopg.connect(url, autocommit=True) as conn:
        assert pruner.run(conn).deleted == 0


def prune_cli(settings: Settings, *args: str) -> Ran:
    """``pipeline prune ARGS`` in this process (the command, not its process, is tested)."""
    env = pipeline_env(
        settings,
        "",
        PIPELINE_SENT_RETENTION_SECONDS=str(RETENTION),
        PIPELINE_INBOX_RETENTION_SECONDS=str(RETENTION),
        PIPELINE_ATTEMPTS_RETENTION_SECONDS=str(RETENTION),
        PIPELINE_AUDIT_RETENTION_SECONDS=str(RETENTION),
    )
    return run_cli(["prune", *args], env)


def test_dry_run_changes_nothing_and_reports_what_prune_then_deletes(retention_settings):
    url = retention_settings.require_database_url()
    seeded = seed(url)
    before = checksums(url)
    dry = prune_cli(retention_settings, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert checksums(url) == before  # not even an audit record
    counted = json.loads(dry.stdout)
    assert counted["dry_run"] is True and counted["deleted"] == 0
    assert {t["table"]: t["eligible"] for t in counted["tables"]} == {
        "outbox": 3,
        # keys whose event is already gone; the key of an event this same prune deletes
        # becomes eligible only once that event is gone
        "inbox": 2,
        "attempts": 3,
        "delivery_log": 3,
        "audit_log": 3,
    }

    done = prune_cli(retention_settings, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {t["table"]: t["deleted"] for t in report["tables"]} == {
        "outbox": 3,
        "inbox": 3,
        "attempts": 3,
        "delivery_log": 3,
        "audit_log": 3,
    }
    assert_pruned(url, seeded)
    with psycopg.connect(url) as conn:
        audit = conn.execute(
            "SELECT actor, parameters, affected FROM pipeline.audit_log WHERE action = 'prune'"
        ).fetchall()
    assert len(audit) == 1
    actor, parameters, affected = audit[0]
    assert actor and affected == 15
    assert parameters["retention_seconds"]["outbox"] == RETENTION

    text = prune_cli(retention_settings, "--dry-run")
    assert text.returncode == 0
    assert text.stdout.splitlines()[0] == "prune (dry run): would delete 0 rows"


def test_prune_and_doctor_judge_a_short_inbox_retention_in_the_words_a_worker_refuses_with(
    retention_settings,
):
    """The same settings and consumers as a worker that refuses to start (the unit tests
    show the worker, relay and janitor refusing): prune refuses too, dry run or not, and
    deletes nothing; the doctor reports the same line as its problem and fix. One second
    more and prune runs."""
    url = retention_settings.require_database_url()
    seed(url)
    before = checksums(url)
    slow = ConsumerPolicy.resolve(retention_settings, "slowpoke", max_retries=10, max_backoff=3600)
    short = int(slow.retry_horizon) - 1
    (problem,) = retention_problems(
        retention_settings.replace(inbox_retention_seconds=short), [slow]
    )
    env = {
        "PIPELINE_SENT_RETENTION_SECONDS": str(RETENTION),
        "PIPELINE_INBOX_RETENTION_SECONDS": str(short),
        "PIPELINE_ATTEMPTS_RETENTION_SECONDS": str(RETENTION),
        "PIPELINE_AUDIT_RETENTION_SECONDS": str(RETENTION),
    }

    for args in (["--dry-run"], []):
        refused = cli(retention_settings, SLOW_APP, "prune", *args, **env)
        assert refused.returncode == 1, refused.stdout
        assert refused.stderr.strip().splitlines() == [f"pipeline: error: {problem}"]
    assert checksums(url) == before  # nothing deleted, not even an audit record

    doctor = cli(retention_settings, SLOW_APP, "doctor", "--json", **env)
    assert doctor.returncode == 1, doctor.stderr
    (finding,) = [
        f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "inbox_retention"
    ]
    assert finding["status"] == "problem"
    assert finding["summary"] == problem.summary
    assert finding["fix"].startswith(f"{problem.fix} (")

    env["PIPELINE_INBOX_RETENTION_SECONDS"] = str(problem.needed)
    done = cli(retention_settings, SLOW_APP, "prune", "--json", **env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["deleted"] > 0  # what the refusals held back


def cli(settings: Settings, app: str, *args: str, **env: str) -> Ran:
    """``pipeline ARGS`` in this process, with test app ``app``'s consumers."""
    return run_cli(args, pipeline_env(settings, app, **env))


def test_prune_refuses_while_another_pass_holds_the_lock(retention_settings):
    url = retention_settings.require_database_url()
    with psycopg.connect(url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtext('pipeline.prune.pipeline'))")
        busy = prune_cli(retention_settings)
    assert busy.returncode == 1
    assert busy.stderr.strip().splitlines() == [
        "pipeline: error: another prune is running (a relay's janitor or `pipeline prune`); "
        "try again when it has finished"
    ]
    assert "Traceback" not in busy.stderr


def test_janitor_in_a_relay_process_prunes_and_counts(retention_settings, tmp_path):
    from tests.integration.test_observability import free_port, scrape

    url = retention_settings.require_database_url()
    seeded = seed(url)
    port = free_port()
    log = tmp_path / "relay.log"
    env_settings = {
        "PIPELINE_SENT_RETENTION_SECONDS": str(RETENTION),
        "PIPELINE_INBOX_RETENTION_SECONDS": str(RETENTION),
        "PIPELINE_ATTEMPTS_RETENTION_SECONDS": str(RETENTION),
        "PIPELINE_AUDIT_RETENTION_SECONDS": str(RETENTION),
        "PIPELINE_PRUNE_INTERVAL_SECONDS": "0.5",
        "PIPELINE_PRUNE_BATCH_SIZE": "2",
        "PIPELINE_METRICS_PORT": str(port),
        "PIPELINE_STATE_METRICS_INTERVAL": "0.1",
    }
    relay = start_process(
        cli_argv("relay", "--mode", "inline"),
        pipeline_env(retention_settings, "tests.apps.relay_app", **env_settings),
        log,
    )
    try:
        wait_until(lambda: remaining(url)["audit"] == seeded.audit_kept, timeout=60, interval=0.2)

        def counted() -> dict[str, float] | None:
            try:
                text = scrape(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                return None
            found = dict(
                re.findall(r'^pipeline_pruned_rows_total\{table="(\w+)"\} (\S+)$', text, re.M)
            )
            values = {table: float(value) for table, value in found.items()}
            return values if sum(values.values()) == 15 else None

        values = wait_until(counted, timeout=30, interval=0.2)
        sizes = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        stop_process(relay)
    assert relay.returncode == 0, log.read_text()
    assert_pruned(url, seeded)
    assert values == {table: 3.0 for table in TABLES}
    for table in TABLES:
        assert re.search(rf'^pipeline_table_size_bytes\{{table="{table}"\}} [1-9]', sizes, re.M)
        assert f'pipeline_table_rows_estimate{{table="{table}"}}' in sizes
