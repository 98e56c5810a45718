"""``pipeline dlq``: list, show, dry runs, replay of both stages, the sandbox, purge, audit.

Dead letters are made the way production makes them: a relay and a Dramatiq worker run
against real Postgres and Redis, and a handler fails permanently until the test "deploys
a fix" (tests/apps/dlq_app.py). They run in this process (counts read from its metrics
registry as differences): no test here is about a process. Commands run through the real
CLI in this process (click's ``CliRunner``: the same group, the same exit codes and
one-line errors); a few run as ``python -m pipeline.tools.cli`` subprocesses, end to end.
"""

from __future__ import annotations

import getpass
import json
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import text

from pipeline import NewEvent, Settings
from pipeline.inbox.idempotency import idempotency_key
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.runtime import build_runtime
from pipeline.tools.harness.payment_api import PaymentServer
from pipeline.transport.publisher import Delivery
from tests.support import (
    QUICK_FAULTS,
    Counted,
    Ran,
    installed_settings,
    pipeline_env,
    produce,
    queue_messages,
    run_cli,
    run_cli_process,
    running_pipeline,
    wait_until,
)

APP = "tests.apps.dlq_app"
TABLES = """
CREATE TABLE effects (id bigserial PRIMARY KEY, consumer text NOT NULL, order_id text NOT NULL,
                      event_id uuid NOT NULL);
CREATE TABLE dlq_switches (consumer text PRIMARY KEY, broken boolean NOT NULL);
INSERT INTO dlq_switches VALUES ('payments', true);
"""
QUEUES = ("pipeline.payments", "pipeline.audit", "pipeline.shipping")


@pytest.fixture
def dlq_settings(settings: Settings, engine) -> Iterator[Settings]:
    with installed_settings(settings, engine, TABLES, **QUICK_FAULTS) as value:
        yield value


def dlq(settings: Settings, *args: str, **env: str) -> Ran:
    """``pipeline dlq ARGS`` in this process, with the settings as PIPELINE_* variables."""
    return run_cli(["dlq", *args], pipeline_env(settings, APP, **env))


def dlq_process(settings: Settings, *args: str, **env: str) -> Ran:
    """``pipeline dlq ARGS`` in a child process: the end-to-end check."""
    return run_cli_process(["dlq", *args], pipeline_env(settings, APP, **env))


def dlq_json(settings: Settings, *args: str, **env: str) -> Any:
    result = dlq(settings, *args, "--json", **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def one_line_error(result: Ran, code: int, expected: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pipeline: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def checksums(settings: Settings, skip: Sequence[str] = ()) -> dict[str, str]:
    """An md5 of every row of every table in the pipeline schema and the app's tables."""
    found: dict[str, str] = {}
    with psycopg.connect(settings.require_database_url()) as conn:
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_schema IN ('pipeline', 'public') AND table_type = 'BASE TABLE'"
        ).fetchall()
        for schema, table in tables:
            if table in skip:
                continue
            query = sql.SQL(
                "SELECT count(*), md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), ''))"
                " FROM {}.{} t"
            ).format(sql.Identifier(schema), sql.Identifier(table))
            count, digest = conn.execute(query).fetchone()
            found[f"{schema}.{table}"] = f"{count}:{digest}"
    assert "pipeline.outbox" in found and "public.effects" in found
    return found


def queues(settings: Settings) -> dict[str, list[list[str]]]:
    """Per queue, the event ids of each waiting message."""
    return {
        queue: [
            [e["id"] for e in message["args"][0]] for message in queue_messages(settings, queue)
        ]
        for queue in QUEUES
    }


def rows(engine, query: str, **params: Any) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(query), params)]


def effects(engine, consumer: str) -> Counter[str]:
    return Counter(
        r[0] for r in rows(engine, "SELECT order_id FROM effects WHERE consumer = :c", c=consumer)
    )


def set_broken(engine, broken: bool) -> None:
    with engine.begin() as conn:
        conn.execute(text("UPDATE dlq_switches SET broken = :b"), {"b": broken})


def orders_with_poison(engine, settings: Settings) -> dict[str, uuid.UUID]:
    """Six orders through a relay and a worker (in this process); payments dead-letters
    o1, o2 and o4.

    o1 and o2 share an ordering key. Returns order id -> event id.
    """
    poison = {"o1", "o2", "o4"}
    with running_pipeline(settings, APP, threads=2):
        names = [f"o{i}" for i in range(6)]
        events = [
            NewEvent(
                "order.placed",
                {"order_id": o, "poison": o in poison},
                aggregate_type="order",
                aggregate_id="k12" if o in ("o1", "o2") else o,
            )
            for o in names
        ]
        ids = dict(zip(names, produce(engine, events, per_transaction=1), strict=True))
        wait_until(
            lambda: (
                rows(engine, "SELECT count(*) FROM pipeline.dead_letters")[0][0] == 3
                and sum(effects(engine, "audit").values()) == 6
                and sum(effects(engine, "shipping").values()) == 3
            ),
            timeout=60,
        )
    assert effects(engine, "payments") == Counter({o: 1 for o in names if o not in poison})
    return ids


def test_dry_run_changes_nothing_then_replay_reaches_only_that_consumer(engine, dlq_settings):
    ids = orders_with_poison(engine, dlq_settings)
    listed = dlq_json(dlq_settings, "list", "--consumer", "payments")
    assert sorted(d["event_id"] for d in listed) == sorted(str(ids[o]) for o in ("o1", "o2", "o4"))
    assert {d["error_class"] for d in listed} == {"Poison"}
    assert {d["inbox_status"] for d in listed} == {"dead"}
    dead = {d["event_id"]: d["id"] for d in listed}

    before, waiting = checksums(dlq_settings), queues(dlq_settings)
    plan = dlq_json(dlq_settings, "replay", "--dry-run")
    text_plan = dlq(dlq_settings, "replay", "--dry-run", "--reason", "look first", "--rate", "2")
    assert checksums(dlq_settings) == before
    assert queues(dlq_settings) == waiting
    assert plan["dry_run"] and plan["would_replay"] == 3
    assert [s["event_ids"] for s in plan["steps"]] == [[str(ids[o])] for o in ("o1", "o2", "o4")]
    assert {(s["action"], s["queue"]) for s in plan["steps"]} == {("deliver", "pipeline.payments")}
    assert text_plan.returncode == 0, text_plan.stderr
    assert "would deliver" in text_plan.stdout and "for payments only" in text_plan.stdout
    assert "dry run: 3 of 3 dead letter(s) would be replayed; nothing changed" in text_plan.stdout
    assert "paced at 2 events/s" in text_plan.stdout

    set_broken(engine, False)  # the fix is deployed
    scoped = [ids["o2"], ids["o1"]]
    result = dlq_json(
        dlq_settings,
        "replay",
        "--consumer",
        "payments",
        *[arg for event in scoped for arg in ("--event-id", str(event))],
        "--reason",
        "fix deployed",
    )
    assert (result["replayed"], result["skipped"], result["failed"]) == (2, 0, 0)
    # one message per dead letter, in sequence order, on the payments queue alone
    assert queues(dlq_settings) == {
        "pipeline.payments": [[str(ids["o1"])], [str(ids["o2"])]],
        "pipeline.audit": [],
        "pipeline.shipping": [],
    }
    inbox = rows(
        engine,
        "SELECT event_id, status, attempts FROM pipeline.inbox"
        " WHERE consumer = 'payments' AND event_id = ANY(:ids) ORDER BY event_id",
        ids=[ids["o1"], ids["o2"], ids["o4"]],
    )
    assert {(r[1], r[2]) for r in inbox if r[0] != ids["o4"]} == {("pending", 0)}
    assert [r[1] for r in inbox if r[0] == ids["o4"]] == ["dead"]
    marked = rows(
        engine, "SELECT id, replay_count FROM pipeline.dead_letters WHERE replayed_at IS NOT NULL"
    )
    assert sorted(marked) == sorted((dead[str(e)], 1) for e in scoped)

    counted = Counted(
        processed=("pipeline_inbox_processed_total", {"consumer": "payments"}),
        audited=("pipeline_inbox_processed_total", {"consumer": "audit"}),
        audit_duplicates=("pipeline_inbox_duplicates_total", {"consumer": "audit"}),
    )
    with running_pipeline(dlq_settings, APP, threads=2):
        wait_until(
            lambda: effects(engine, "shipping")["o1"] == effects(engine, "shipping")["o2"] == 1,
            timeout=60,
        )
    # the replayed handler ran once per event; the other consumer never saw them again
    assert effects(engine, "payments") == Counter({o: 1 for o in ("o0", "o1", "o2", "o3", "o5")})
    assert effects(engine, "audit") == Counter({f"o{i}": 1 for i in range(6)})
    assert effects(engine, "shipping") == Counter({o: 1 for o in ("o0", "o1", "o2", "o3", "o5")})
    assert counted("processed") == 2
    assert counted("audited") == 0
    assert counted("audit_duplicates") == 0
    assert rows(
        engine,
        "SELECT status, attempts FROM pipeline.inbox WHERE consumer = 'payments' AND event_id = :e",
        e=ids["o1"],
    ) == [("processed", 1)]

    audit = dlq_json(dlq_settings, "audit")
    assert len(audit) == 1  # the dry runs were not recorded
    (record,) = audit
    assert record["actor"] == getpass.getuser()
    assert record["action"] == "dlq.replay"
    assert record["affected"] == 2
    assert record["parameters"]["reason"] == "fix deployed"
    assert record["parameters"]["filter"] == {
        "consumer": "payments",
        "event_id": [str(e) for e in scoped],
    }
    assert sorted(record["parameters"]["dead_letters"]) == sorted(dead[str(e)] for e in scoped)
    listing = dlq(dlq_settings, "audit")
    assert "dlq.replay" in listing.stdout and "'fix deployed'" in listing.stdout

    # a second replay of the same scope finds nothing waiting; by --id it says why
    again = dlq_json(dlq_settings, "replay", "--id", str(dead[str(ids["o1"])]), "--reason", "x")
    assert again["replayed"] == 0
    assert again["results"][0]["detail"].startswith("already replayed at")


def test_replayed_event_that_fails_again_is_a_new_dead_letter(engine, dlq_settings):
    ids = orders_with_poison(engine, dlq_settings)
    replayed = dlq_json(
        dlq_settings, "replay", "--event-id", str(ids["o4"]), "--reason", "try without fix"
    )
    assert replayed["replayed"] == 1
    with running_pipeline(dlq_settings, APP, threads=1):
        wait_until(
            lambda: rows(engine, "SELECT count(*) FROM pipeline.dead_letters")[0][0] == 4,
            timeout=60,
        )
    letters = rows(
        engine,
        "SELECT replay_count, replayed_at IS NOT NULL FROM pipeline.dead_letters"
        " WHERE event_id = :e ORDER BY id",
        e=ids["o4"],
    )
    assert letters == [(1, True), (0, False)]
    waiting = dlq_json(dlq_settings, "list", "--waiting", "--event-id", str(ids["o4"]))
    assert len(waiting) == 1 and waiting[0]["replay_count"] == 0


class FailFor:
    """Fails every delivery to one consumer; passes the others to the real publisher."""

    def __init__(self, inner, consumer: str) -> None:
        self.inner, self.consumer = inner, consumer

    def deliver(self, deliveries: Sequence[Delivery]):
        passed = [d for d in deliveries if d.subscription.consumer != self.consumer]
        outcomes = iter(self.inner.deliver(passed))
        return [
            RuntimeError("the payments queue rejected it")
            if d.subscription.consumer == self.consumer
            else next(outcomes)
            for d in deliveries
        ]

    def oldest_waiting(self, queue: str):
        return self.inner.oldest_waiting(queue)

    def forgot(self) -> bool:
        return self.inner.forgot()

    def close(self) -> None:
        pass


def test_publish_stage_replay_is_published_consumed_and_deduplicated(engine, dlq_settings):
    set_broken(engine, False)
    routes = Registry()
    routes.subscribe("payments", ["order.placed"])
    routes.subscribe("audit", ["order.placed"])
    once = dlq_settings.replace(publish_max_attempts=1)
    runtime = build_runtime(once, routes, set_global_broker=False)
    names = ["p0", "p1", "p2"]
    ids = dict(
        zip(
            names,
            produce(engine, [NewEvent("order.placed", {"order_id": o}) for o in names]),
            strict=True,
        )
    )
    try:
        conn = psycopg.connect(once.require_database_url(), autocommit=True)
        drainer = Drainer(once, FailFor(runtime.publisher, "payments"), routes, "t", conn)
        while drainer.run_batch().claimed:
            pass
        conn.close()
    finally:
        runtime.close()
    # audit got every event; payments none: the relay gave up on all three
    audit_copies = [e for message in queues(dlq_settings)["pipeline.audit"] for e in message]
    assert audit_copies == [str(ids[o]) for o in names]
    dead = dlq_json(dlq_settings, "list", "--stage", "publish")
    assert [d["event_id"] for d in dead] == [str(ids[o]) for o in names]
    assert {d["outbox_status"] for d in dead} == {"dead"}
    with running_pipeline(dlq_settings, APP, threads=2):
        wait_until(lambda: sum(effects(engine, "audit").values()) == 3, timeout=60)

    before = checksums(dlq_settings)
    plan = dlq_json(dlq_settings, "replay", "--stage", "publish", "--dry-run", "--reason", "r")
    assert checksums(dlq_settings) == before
    assert [s["action"] for s in plan["steps"]] == ["requeue"] * 3
    assert "payments" in plan["steps"][0]["detail"] and "audit" in plan["steps"][0]["detail"]

    scope = [dead[0]["id"], dead[1]["id"]]  # p0 and p1; p2 stays dead
    result = dlq_json(
        dlq_settings,
        "replay",
        "--stage",
        "publish",
        *[arg for i in scope for arg in ("--id", str(i))],
        "--reason",
        "queue fixed",
    )
    assert result["replayed"] == 2
    assert rows(engine, "SELECT id, status, attempts FROM pipeline.outbox ORDER BY seq") == [
        (ids["p0"], "pending", 0),
        (ids["p1"], "pending", 0),
        (ids["p2"], "dead", 1),
    ]
    counted = Counted(duplicates=("pipeline_inbox_duplicates_total", {"consumer": "audit"}))
    with running_pipeline(dlq_settings, APP, threads=2):
        wait_until(lambda: sum(effects(engine, "payments").values()) == 2, timeout=60)
        wait_until(lambda: counted("duplicates") == 2, timeout=60)
    assert effects(engine, "payments") == Counter({"p0": 1, "p1": 1})
    assert effects(engine, "audit") == Counter({"p0": 1, "p1": 1, "p2": 1})  # copies dropped
    statuses = rows(
        engine,
        "SELECT id, status, consumers FROM pipeline.outbox"
        " WHERE event_type = 'order.placed' ORDER BY seq",
    )
    assert statuses == [
        (ids["p0"], "sent", ["audit", "payments"]),
        (ids["p1"], "sent", ["audit", "payments"]),
        (ids["p2"], "dead", None),
    ]
    (record,) = dlq_json(dlq_settings, "audit")
    assert (record["action"], record["affected"]) == ("dlq.replay", 2)
    assert record["parameters"]["filter"] == {"stage": "publish", "id": scope}


def test_sandbox_reports_the_handler_and_leaves_everything_unchanged(
    engine, dlq_settings, monkeypatch
):
    api = PaymentServer().start()
    try:
        # the app reads TEST_PAYMENT_API at import: a child process gets it in its
        # environment, this process (worker and in-process commands) in the module
        env = {"TEST_PAYMENT_API": api.url}
        monkeypatch.setattr("tests.apps.dlq_app.PAYMENT_API", api.url)
        with running_pipeline(dlq_settings, APP, threads=1):
            (poison_id,) = produce(
                engine, [NewEvent("order.placed", {"order_id": "s1", "poison": True})]
            )
            wait_until(
                lambda: rows(engine, "SELECT count(*) FROM pipeline.dead_letters")[0][0] == 1,
                timeout=60,
            )
        assert len(api.ledger.snapshot()["charges"]) == 1  # the worker did call the API
        ledger_before = api.ledger.snapshot()
        before = checksums(dlq_settings, skip=["audit_log"])
        key = idempotency_key("payments", poison_id)

        (letter,) = dlq_json(dlq_settings, "list")
        shown = dlq(dlq_settings, "show", str(letter["id"]))
        assert "Poison: cannot charge order s1" in shown.stdout  # the error and its attempt
        assert "Poison: Poison" not in shown.stdout  # the class written once

        # the handler still fails: the sandbox says so, and so does its exit code
        failing = dlq(dlq_settings, "replay", "--to-sandbox", "--reason", "check", "--json", **env)
        assert failing.returncode == 1, failing.stderr
        still_broken = json.loads(failing.stdout)
        (run,) = still_broken["runs"]
        (outcome,) = run["results"]
        assert (outcome["outcome"], outcome["error_class"]) == ("error", "Poison")
        assert outcome["error"] == "Poison: cannot charge order s1"
        assert outcome["retryable"] is False

        set_broken(engine, False)
        before = checksums(dlq_settings, skip=["audit_log"])
        fixed = dlq_json(dlq_settings, "replay", "--to-sandbox", "--reason", "check fix", **env)
        (run,) = fixed["runs"]
        (outcome,) = run["results"]
        assert outcome["outcome"] == "ok" and outcome["event_id"] == str(poison_id)
        assert [p["type"] for p in outcome["published"]] == ["payment.charged"]
        assert outcome["external_calls"] == [
            {"method": "POST", "url": f"{api.url}/v1/charges", "idempotency_key": key}
        ]
        text_run = dlq_process(dlq_settings, "replay", "--to-sandbox", "--reason", "again", **env)
        assert text_run.returncode == 0, text_run.stderr
        assert "would publish payment.charged" in text_run.stdout
        assert f"would call POST {api.url}/v1/charges (Idempotency-Key {key}; not sent)" in (
            text_run.stdout
        )
        # nothing kept: every table but the audit log, and the payment API's ledger
        assert checksums(dlq_settings, skip=["audit_log"]) == before
        assert api.ledger.snapshot() == ledger_before
        actions = dlq_json(dlq_settings, "audit")
        assert [(a["action"], a["affected"]) for a in actions] == [("dlq.replay.sandbox", 1)] * 3
        assert actions[1]["parameters"]["reason"] == "check fix"
    finally:
        api.stop()


def fabricate(engine, count: int, key: str = "k") -> list[tuple[uuid.UUID, int]]:
    """Consume-stage dead letters for ``count`` sent events of one key, dead-lettered in
    reverse order (the newest event first); returns (event id, dead letter id) by seq."""
    events = produce(
        engine,
        [NewEvent("order.placed", {"order_id": f"f{i}"}, aggregate_id=key) for i in range(count)],
    )
    made = []
    with engine.begin() as conn:
        conn.execute(text("UPDATE pipeline.outbox SET status = 'sent', consumers = '{payments}'"))
        for event_id in reversed(events):
            conn.execute(
                text(
                    "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status, attempts)"
                    " VALUES ('payments', :e, 'order.placed', 'dead', 3)"
                ),
                {"e": event_id},
            )
            made.append(
                conn.execute(
                    text(
                        "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, event_type,"
                        " queue, reason, error_class, error, attempts) VALUES ('consume', :e,"
                        " 'payments', 'order.placed', 'pipeline.payments', 'gave up after 3"
                        " attempts', 'Flaky', 'Flaky: down', 3) RETURNING id"
                    ),
                    {"e": event_id},
                ).scalar()
            )
    return list(zip(events, reversed(made), strict=True))


def test_replay_keeps_sequence_order_and_limit(engine, dlq_settings):
    made = fabricate(engine, 5)
    result = dlq_json(dlq_settings, "replay", "--limit", "3", "--rate", "50", "--reason", "r")
    assert [r["id"] for r in result["results"]] == [d for _, d in made[:3]]
    assert queues(dlq_settings)["pipeline.payments"] == [[str(e)] for e, _ in made[:3]]
    (record,) = dlq_json(dlq_settings, "audit")
    assert (record["parameters"]["limit"], record["parameters"]["rate"]) == (3, 50.0)
    rest = dlq_json(dlq_settings, "replay", "--reason", "r")
    assert [r["id"] for r in rest["results"]] == [d for _, d in made[3:]]


def test_replay_is_an_operation_that_returns_what_it_did_and_prints_nothing(
    engine, dlq_settings, capsys
):
    from pipeline.tools.ops.dlq.access import audit_log
    from pipeline.tools.ops.dlq.filters import build_filter
    from pipeline.tools.ops.dlq.replay_run import ReplayRequest, replay_dead_letters

    made = fabricate(engine, 3)
    scope = build_filter(consumer="payments")
    dry = replay_dead_letters(dlq_settings, ReplayRequest(scope, dry_run=True))
    assert dry.report is None and dry.sandbox is None
    assert [step.letter.id for step in dry.plan.acting] == [d for _, d in made]
    assert (
        queues(dlq_settings)["pipeline.payments"] == [] and audit_log(dlq_settings, limit=5) == []
    )
    seen: list[int] = []
    done = replay_dead_letters(
        dlq_settings,
        ReplayRequest(scope, "from Python", limit=2),
        lambda result: seen.append(result.step.letter.id),
    )
    assert done.report is not None and not done.failed
    assert seen == [d for _, d in made[:2]] and done.report.count("replayed") == 2
    assert queues(dlq_settings)["pipeline.payments"] == [[str(e)] for e, _ in made[:2]]
    (record,) = audit_log(dlq_settings, limit=5)
    assert (record.id, record.action, record.affected) == (done.report.audit_id, "dlq.replay", 2)
    assert record.parameters["reason"] == "from Python"
    assert capsys.readouterr() == ("", "")


def test_causation_chain_time_window_and_show(engine, dlq_settings):
    from sqlalchemy.orm import Session

    from pipeline import add_event

    with Session(engine) as session, session.begin():
        root = add_event(session, "order.placed", {"order_id": "c"})
        child = add_event(session, "payment.charged", {"order_id": "c"}, causation_id=root)
        grandchild = add_event(session, "stock.reserved", {"order_id": "c"}, causation_id=child)
        other = add_event(session, "order.placed", {"order_id": "x"})
    with engine.begin() as conn:
        for event, consumer, age in (
            (child, "shipping", "2 hours"),
            (grandchild, "shipping", "10 minutes"),
            (other, "payments", "3 days"),
        ):
            conn.execute(
                text(
                    "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, event_type,"
                    " reason, error_class, error, created_at, envelope) VALUES ('consume', :e, :c,"
                    " 'x', 'gave up', 'Boom', 'Boom: secret-free', now() - CAST(:age AS interval),"
                    " CAST(:env AS jsonb))"
                ),
                {
                    "e": event,
                    "c": consumer,
                    "age": age,
                    "env": json.dumps({"id": str(event), "data": {"card": "4242"}}),
                },
            )
    chain = dlq_json(dlq_settings, "list", "--caused-by", str(root))
    assert [d["event_id"] for d in chain] == [str(child), str(grandchild)]
    recent = dlq_json(dlq_settings, "list", "--since", "1h")
    assert [d["event_id"] for d in recent] == [str(grandchild)]
    window = dlq_json(dlq_settings, "list", "--since", "4d", "--until", "1d")
    assert [d["event_id"] for d in window] == [str(other)]
    assert dlq_json(dlq_settings, "list", "--error-class", "Nope") == []

    shown = dlq(dlq_settings, "show", str(chain[0]["id"]))
    assert shown.returncode == 0, shown.stderr
    assert "Boom: secret-free" in shown.stdout and f"pipeline trace {child}" in shown.stdout
    assert "4242" not in shown.stdout  # the payload only with --payload
    assert "4242" in dlq(dlq_settings, "show", str(chain[0]["id"]), "--payload").stdout


def test_purge_needs_a_scope_deletes_only_dead_letters_and_is_audited(engine, dlq_settings):
    made = fabricate(engine, 3)
    one_line_error(
        dlq(dlq_settings, "purge", "--reason", "r"), 2, "refusing to purge without a scope"
    )
    one_line_error(
        dlq(dlq_settings, "purge", "--all", "--stage", "consume", "--reason", "r"), 2, "not both"
    )
    before = checksums(dlq_settings)
    plan = dlq_json(dlq_settings, "purge", "--consumer", "payments", "--dry-run", "--reason", "r")
    assert plan["would_delete"] == 3
    assert checksums(dlq_settings) == before
    result = dlq_json(dlq_settings, "purge", "--id", str(made[0][1]), "--reason", "handled by hand")
    assert result["deleted"] == [made[0][1]]
    assert rows(engine, "SELECT count(*) FROM pipeline.dead_letters") == [(2,)]
    # the inbox row stays dead: nothing runs again, nothing is owed
    assert rows(engine, "SELECT status FROM pipeline.inbox WHERE event_id = :e", e=made[0][0]) == [
        ("dead",)
    ]
    everything = dlq_json(dlq_settings, "purge", "--all", "--reason", "clean slate")
    assert sorted(everything["deleted"]) == sorted(d for _, d in made[1:])
    actions = dlq_json(dlq_settings, "audit")
    assert [(a["action"], a["affected"], a["parameters"]["filter"]) for a in actions] == [
        ("dlq.purge", 2, {"all": True}),
        ("dlq.purge", 1, {"id": [made[0][1]]}),
    ]
    assert actions[1]["parameters"]["reason"] == "handled by hand"
    assert {a["actor"] for a in actions} == {getpass.getuser()}


def test_bad_arguments_and_unknown_ids_are_one_line(dlq_settings):
    # one of each kind as a real process: exit code and stderr as a shell sees them
    one_line_error(dlq_process(dlq_settings, "show", "999999"), 1, "no dead letter #999999")
    one_line_error(dlq_process(dlq_settings, "show", "abc"), 2, "'abc' is not a valid integer")
    one_line_error(dlq(dlq_settings, "show", "999999"), 1, "no dead letter #999999")
    one_line_error(dlq(dlq_settings, "show", "abc"), 2, "'abc' is not a valid integer")
    one_line_error(
        dlq(dlq_settings, "replay", "--id", "424242", "--reason", "r"), 1, "no dead letter #424242"
    )
    one_line_error(
        dlq(dlq_settings, "list", "--since", "yesterday"), 2, "neither an ISO-8601 timestamp"
    )
    one_line_error(dlq(dlq_settings, "list", "--event-id", "nope"), 2, "is not an event id")
    one_line_error(dlq(dlq_settings, "list", "--stage", "both"), 2, "--stage")
    one_line_error(dlq(dlq_settings, "replay"), 2, "Missing option '--reason'")
    one_line_error(dlq(dlq_settings, "purge", "--all"), 2, "Missing option '--reason'")
    one_line_error(dlq(dlq_settings, "replay", "--reason", " "), 2, "--reason must say why")
    one_line_error(dlq(dlq_settings, "replay", "--rate", "0", "--reason", "r"), 2, "--rate")
    one_line_error(
        dlq(dlq_settings, "replay", "--to-sandbox", "--stage", "publish", "--reason", "r"),
        2,
        "--to-sandbox runs consume-stage dead letters",
    )
    assert dlq_json(dlq_settings, "list") == []
    assert dlq(dlq_settings, "list").stdout.strip() == "no dead letters match"


def test_consumer_unknown_to_registry_and_without_queue_is_refused(engine, dlq_settings):
    (event,) = produce(engine, [NewEvent("order.placed", {"order_id": "u"})])
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, reason, error_class,"
                " error) VALUES ('consume', :e, 'retired', 'gave up', 'Boom', 'Boom')"
            ),
            {"e": event},
        )
    before = checksums(dlq_settings)
    result = dlq(dlq_settings, "replay", "--reason", "r")
    one_line_error(result, 1, "no queue known for consumer(s) retired")
    assert checksums(dlq_settings) == before
    plan = dlq_json(dlq_settings, "replay", "--dry-run", "--reason", "r")
    assert plan["steps"][0]["action"] == "unroutable"


def test_replay_skips_what_the_consumer_processed_since_and_uses_kept_envelopes(
    engine, dlq_settings
):
    (done, _), (gone, gone_letter) = fabricate(engine, 2)
    envelope = queue_free_envelope(engine, gone)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE pipeline.inbox SET status = 'processed' WHERE event_id = :e"), {"e": done}
        )
        conn.execute(
            text("UPDATE pipeline.dead_letters SET envelope = CAST(:env AS jsonb) WHERE id = :d"),
            {"env": json.dumps(envelope), "d": gone_letter},
        )
        conn.execute(text("DELETE FROM pipeline.outbox WHERE id = :e"), {"e": gone})
    result = dlq_json(dlq_settings, "replay", "--reason", "r")
    first = result["results"][0]
    assert (first["outcome"], first["detail"]) == (
        "skipped",
        "payments has processed the event since: nothing is owed (purge this one)",
    )
    assert result["results"][1]["outcome"] == "replayed"
    # the pruned event travels again from the envelope the consumer was given
    (message,) = queue_messages(dlq_settings, "pipeline.payments")
    assert message["args"][0] == [envelope]


def queue_free_envelope(engine, event_id: uuid.UUID) -> dict[str, Any]:
    """The envelope the relay makes of an outbox row (as a consumer received it)."""
    from pipeline.envelope import OutboxEvent, encode_envelope

    (row,) = rows(
        engine,
        "SELECT id, seq, aggregate_type, aggregate_id, ordering_key, event_type, event_version,"
        " payload::text, headers::text, attempts, created_at FROM pipeline.outbox WHERE id = :e",
        e=event_id,
    )
    return json.loads(encode_envelope(OutboxEvent(*row), "/pipeline/pipeline"))


def orders_of_two_causes(engine, settings: Settings) -> dict[str, list[uuid.UUID]]:
    """200 orders over ten ordering keys through a relay and a worker; payments
    dead-letters every one: 110 poisoned (Poison, fixed by the switch), 90 with a declined
    card (CardDeclined, stays broken). Returns cause -> event ids in the outbox's sequence
    order (within a transaction, not necessarily the order the events were given in)."""
    causes: dict[str, list[uuid.UUID]] = {"Poison": [], "CardDeclined": []}
    events = []
    for i in range(200):
        data: dict[str, Any] = {"order_id": f"g{i}"}
        if i % 20 < 11:
            data["poison"] = True
        else:
            data["declined"] = 4000 + i
        events.append(NewEvent("order.placed", data, aggregate_id=f"key{i % 10}"))
    with running_pipeline(settings, APP, threads=2):
        ids = produce(engine, events, per_transaction=50)
        wait_until(
            lambda: rows(engine, "SELECT count(*) FROM pipeline.dead_letters")[0][0] == 200,
            timeout=120,
            progress=lambda: rows(engine, "SELECT count(*) FROM pipeline.dead_letters")[0][0],
        )
    poisoned = {event_id for i, event_id in enumerate(ids) if i % 20 < 11}
    for (event_id,) in rows(engine, "SELECT id FROM pipeline.outbox ORDER BY seq"):
        causes["Poison" if event_id in poisoned else "CardDeclined"].append(event_id)
    return causes


def test_groups_replay_exactly_one_cause_in_order_audited(engine, dlq_settings):
    causes = orders_of_two_causes(engine, dlq_settings)
    groups = dlq_json(dlq_settings, "groups")
    assert [(g["error_class"], g["count"], g["waiting"]) for g in groups] == [
        ("Poison", 110, 110),
        ("CardDeclined", 90, 90),
    ]
    assert {(g["stage"], g["consumer"], g["event_type"]) for g in groups} == {
        ("consume", "payments", "order.placed")
    }
    poison, declined = groups
    assert poison["message"] == "cannot charge order g<n>"
    assert declined["message"] == "card <n> declined for order <str> (reference <uuid>)"
    assert poison["fingerprint"] != declined["fingerprint"]
    table = dlq(dlq_settings, "groups")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:3] == ["FINGERPRINT", "COUNT", "WAITING"]
    assert f"{poison['fingerprint']}    110      110" in table.stdout
    assert "2 group(s), 200 dead letter(s)" in table.stdout

    # without --yes, a group replay is a dry run: nothing changes, nothing is audited
    before, waiting = checksums(dlq_settings), queues(dlq_settings)
    plan = dlq_json(dlq_settings, "replay", "--group", poison["fingerprint"])
    shown = dlq(dlq_settings, "replay", "--group", poison["fingerprint"])
    assert checksums(dlq_settings) == before and queues(dlq_settings) == waiting
    assert plan["dry_run"] and plan["would_replay"] == 110 and plan["rate"] == 50.0
    assert [s["event_ids"] for s in plan["steps"]] == [[str(e)] for e in causes["Poison"]]
    assert "to replay this group: the same command with --yes --reason WHY" in shown.stdout
    one_line_error(
        dlq(dlq_settings, "replay", "--group", poison["fingerprint"], "--yes"),
        2,
        "Missing option '--reason'",
    )
    one_line_error(
        dlq(dlq_settings, "replay", "--group", "0123456789ab"), 1, "no dead letter in scope"
    )
    one_line_error(dlq(dlq_settings, "groups", "--group", "nope"), 2, "is not a fingerprint")

    set_broken(engine, False)  # the fix for one cause is deployed
    # trying the fix on a few of the group in the sandbox needs no --yes and keeps nothing
    before = checksums(dlq_settings, skip=["audit_log"])
    tried = dlq_json(
        dlq_settings,
        *("replay", "--group", poison["fingerprint"], "--to-sandbox", "--limit", "3"),
        *("--reason", "try the fix"),
    )
    assert [r["results"][0]["outcome"] for r in tried["runs"]] == ["ok"] * 3, tried
    assert checksums(dlq_settings, skip=["audit_log"]) == before
    done = dlq_json(
        dlq_settings, "replay", "--group", poison["fingerprint"], "--yes", "--reason", "fixed"
    )
    assert (done["replayed"], done["skipped"], done["failed"]) == (110, 0, 0)
    # one message per dead letter on the payments queue, in the events' sequence order
    assert queues(dlq_settings) == {
        "pipeline.payments": [[str(e)] for e in causes["Poison"]],
        "pipeline.audit": [],
        "pipeline.shipping": [],
    }
    record, sandboxed = dlq_json(dlq_settings, "audit")
    assert sandboxed["parameters"]["reason"] == "try the fix"
    assert (record["action"], record["affected"]) == ("dlq.replay", 110)
    assert record["parameters"]["filter"] == {"group": poison["fingerprint"]}
    assert (record["parameters"]["rate"], record["parameters"]["reason"]) == (50.0, "fixed")
    assert len(record["parameters"]["dead_letters"]) == 110
    after = {g["error_class"]: (g["count"], g["waiting"]) for g in dlq_json(dlq_settings, "groups")}
    assert after == {"Poison": (110, 0), "CardDeclined": (90, 90)}

    # a relay and a worker take the replayed deliveries
    counted = Counted(processed=("pipeline_inbox_processed_total", {"consumer": "payments"}))
    with running_pipeline(dlq_settings, APP, threads=2):
        wait_until(
            lambda: sum(effects(engine, "shipping").values()) == 110,
            timeout=120,
            progress=lambda: sum(effects(engine, "shipping").values()),
        )
    assert counted("processed") == 110
    statuses = dict(
        rows(
            engine,
            "SELECT status, count(*) FROM pipeline.inbox WHERE consumer = 'payments'"
            " GROUP BY status",
        )
    )
    assert statuses == {"processed": 110, "dead": 90}
    assert set(effects(engine, "shipping").values()) == {1}
    assert rows(engine, "SELECT count(*) FROM pipeline.dead_letters")[0][0] == 200  # no new ones

    # the other cause is untouched; purging it is a dry run first too, paced, in event order
    before = checksums(dlq_settings)
    purge_plan = dlq_json(dlq_settings, "purge", "--group", declined["fingerprint"])
    assert purge_plan["would_delete"] == 90 and checksums(dlq_settings) == before
    assert purge_plan["rate"] == 1000.0  # a --group purge is paced unless --rate says
    planned = [letter["event_id"] for letter in purge_plan["dead_letters"]]
    assert planned == [str(e) for e in causes["CardDeclined"]]
    purged = dlq_json(
        dlq_settings,
        *("purge", "--group", declined["fingerprint"], "--rate", "45"),
        *("--yes", "--reason", "refunded"),
    )
    letter_of = {letter["id"]: letter["event_id"] for letter in purge_plan["dead_letters"]}
    assert [letter_of[i] for i in purged["deleted"]] == planned  # deleted in event order
    assert purged["rate"] == 45.0
    assert [g["error_class"] for g in dlq_json(dlq_settings, "groups")] == ["Poison"]
    latest = dlq_json(dlq_settings, "audit")[0]
    assert (latest["action"], latest["affected"]) == ("dlq.purge", 90)
    assert latest["parameters"]["filter"] == {"group": declined["fingerprint"]}
    assert (latest["parameters"]["rate"], latest["parameters"]["reason"]) == (45.0, "refunded")


def publish_to(settings: Settings, routes: Registry, count: int, engine) -> list[uuid.UUID]:
    """``count`` orders published by a relay's drainer with ``routes`` (the real broker)."""
    ids = produce(engine, [NewEvent("order.placed", {"order_id": f"w{i}"}) for i in range(count)])
    runtime = build_runtime(settings, routes, set_global_broker=False)
    try:
        with psycopg.connect(settings.require_database_url(), autocommit=True) as conn:
            drainer = Drainer(settings, runtime.publisher, routes, "t", conn)
            while drainer.run_batch().claimed:
                pass
    finally:
        runtime.close()
    return ids


def owed_gauge(settings: Settings) -> dict[str, int]:
    from pipeline.db.stores.state import StateStore

    with psycopg.connect(settings.require_database_url(), autocommit=True) as conn:
        return StateStore(settings.schema_name).snapshot(conn, 0.0).owed


def sweep(settings: Settings, routes: Registry):
    """One ledger sweep, as a relay with ``routes`` runs it."""
    from pipeline.relay.ledger import DeliveryLedger

    runtime = build_runtime(settings, routes, set_global_broker=False)
    try:
        with psycopg.connect(settings.require_database_url(), autocommit=True) as conn:
            return DeliveryLedger(settings, routes, runtime.publisher).sweep(conn)
    finally:
        runtime.close()


def test_owed_lists_deliveries_and_abandon_finishes_only_a_removed_consumers(engine, dlq_settings):
    # a relay that still routes to "legacy", a consumer the app no longer has
    routes = Registry()
    routes.subscribe("payments", ["order.placed"])
    routes.subscribe("legacy", ["order.placed"])
    now = dlq_settings.replace(redelivery_horizon_seconds=0.01)
    recorded = publish_to(now, routes, 3, engine)
    accounted: list[int] = []

    def swept_all() -> bool:
        result = sweep(now, routes)
        assert not result.redelivered  # the copies still wait on the queues: nothing owed yet
        accounted.append(result.accounted)
        return sum(accounted) == 6

    wait_until(swept_all, timeout=30)
    unrecorded = publish_to(now, routes, 2, engine)  # published after the sweep: no inbox row

    owed = dlq_json(dlq_settings, "owed", "--min-age", "0")
    assert {c["consumer"]: (c["owed"], c["registered"]) for c in owed["consumers"]} == {
        "legacy": (5, False),
        "payments": (5, True),
    }
    legacy = [d for d in owed["deliveries"] if d["consumer"] == "legacy"]
    assert [(d["event_id"], d["recorded"]) for d in legacy] == [
        *[(str(e), True) for e in recorded],
        *[(str(e), False) for e in unrecorded],
    ]
    assert [d["age_seconds"] for d in legacy] == sorted(
        (d["age_seconds"] for d in legacy), reverse=True
    )  # oldest first
    text_owed = dlq(dlq_settings, "owed", "--min-age", "0", "--limit", "4")
    assert text_owed.returncode == 0, text_owed.stderr
    assert "(the oldest 4 of 10; --limit shows more)" in text_owed.stdout
    assert "consumer legacy: 5 owed" in text_owed.stdout
    assert "NOT registered by the app modules" in text_owed.stdout
    assert f"{recorded[0]}  legacy  order.placed  age " in text_owed.stdout
    assert owed_gauge(now) == {"legacy": 5, "payments": 5}

    one_line_error(
        dlq(dlq_settings, "abandon", "--consumer", "payments", "--yes", "--reason", "r"),
        1,
        "consumer 'payments' is registered",
    )
    one_line_error(
        dlq(dlq_settings, "abandon", "--consumer", "legacy", PIPELINE_APP_MODULES=""),
        1,
        "cannot tell whether consumer 'legacy' still exists",
    )
    one_line_error(
        dlq(dlq_settings, "abandon", "--consumer", "legacy", "--yes"),
        2,
        "Missing option '--reason'",
    )
    before = checksums(dlq_settings)
    dry = dlq(dlq_settings, "abandon", "--consumer", "legacy")
    assert dry.returncode == 0, dry.stderr
    assert "dry run: 5 deliveries owed to legacy would be abandoned; nothing changed" in dry.stdout
    assert checksums(dlq_settings) == before and dlq_json(dlq_settings, "audit") == []

    done = dlq_json(
        dlq_settings, "abandon", "--consumer", "legacy", "--yes", "--reason", "legacy removed"
    )
    assert (done["abandoned"], done["owed"]) == (5, 5)
    assert rows(
        engine,
        "SELECT status, last_error_class, count(*) FROM pipeline.inbox"
        " WHERE consumer = 'legacy' GROUP BY 1, 2",
    ) == [("dead", "DeliveryAbandoned", 5)]
    assert rows(engine, "SELECT count(*) FROM pipeline.dead_letters") == [(0,)]
    assert owed_gauge(now) == {"payments": 5}  # the other consumer still owed its five
    (record,) = dlq_json(dlq_settings, "audit")
    assert (record["action"], record["affected"]) == ("dlq.abandon", 5)
    assert record["parameters"] == {
        "consumer": "legacy",
        "force": False,
        "reason": "legacy removed",
    }
    # the next sweep records nothing again for it; nothing is owed to it any more
    again = sweep(now, routes)
    assert (again.accounted, dict(again.redelivered)) == (2, {})  # payments' two, not legacy's
    assert owed_gauge(now) == {"payments": 5}
    assert dlq(dlq_settings, "owed", "--consumer", "legacy", "--min-age", "0").stdout.strip() == (
        "no deliveries owed for 0s or longer"
    )


@pytest.mark.timeout(120)  # a sweep that waits on the worker waits for ever here
def test_a_sweep_never_waits_on_a_workers_open_claim_and_accounts_for_it_later(
    engine, dlq_settings
):
    """A worker claimed a delivery and stopped with its transaction open: its inbox row is
    being inserted, so recording the delivery as owed would wait for that transaction. The
    sweep does not wait (a relay that waited would stop publishing for everyone): it stops
    its accounting there and looks again from that delivery next time, so when the worker's
    transaction rolls back (it died), the delivery is still recorded as owed."""
    from pipeline.db.stores.inbox import InboxStore
    from pipeline.envelope import ReceivedEvent

    routes = Registry()
    routes.subscribe("payments", ["order.placed"])
    now = dlq_settings.replace(redelivery_horizon_seconds=0.01)
    (claimed,) = publish_to(now, routes, 1, engine)
    (later,) = publish_to(now, routes, 1, engine)
    (seq,) = rows(engine, "SELECT seq FROM pipeline.outbox WHERE id = :i", i=claimed)[0]
    event = ReceivedEvent(
        id=claimed, type="order.placed", version=1, data={}, source="t", time="", seq=seq
    )

    def owed_rows() -> list[tuple[Any, ...]]:
        return rows(
            engine,
            "SELECT event_id, status FROM pipeline.inbox WHERE consumer = 'payments'"
            " ORDER BY delivered_at",
        )

    with engine.connect() as worker:  # its transaction stays open
        assert InboxStore(now.schema_name).claim(worker, "payments", event) == 1
        for _ in range(3):
            sweep(now, routes)  # a LockNotAvailable here: the sweep waited on the worker
        assert owed_rows() == []  # neither recorded: the claimed one is the first
        worker.rollback()  # the worker died before its COMMIT
    wait_until(
        lambda: (
            sweep(now, routes) is not None
            and owed_rows() == [(claimed, "pending"), (later, "pending")]
        ),
        timeout=30,
    )


def test_fingerprints_normalise_the_variable_parts_of_a_message(engine, dlq_settings):
    letters = [
        # (consumer, event type, error class, error): the first four are one cause
        ("payments", "order.placed", "Timeout", "Timeout: upstream 0x1f3a after 30.5 s"),
        ("payments", "order.placed", "Timeout", "Timeout: upstream 0xdeadbeef after 2 s"),
        ("payments", "order.placed", "Timeout", "upstream   0x9  after 7 s"),  # no class prefix
        ("payments", "order.placed", "Timeout", "Timeout: upstream 0x0 after 1 s\n"),
        # hex ids, quoted values and UUIDs
        ("payments", "order.placed", "KeyError", "KeyError: 'a1b2c3d4e5f6' in ab12cd34ef"),
        ("payments", "order.placed", "KeyError", 'KeyError: "x" in 0123abcd'),
        ("payments", "order.placed", "KeyError", f"KeyError: {uuid.uuid4()} in 99887766ff"),
        # the same message elsewhere is another cause: consumer, event type, class
        ("audit", "order.placed", "Timeout", "Timeout: upstream 0x1 after 1 s"),
        ("payments", "order.paid", "Timeout", "Timeout: upstream 0x1 after 1 s"),
        ("payments", "order.placed", "Slow", "Slow: upstream 0x1 after 1 s"),
    ]
    with engine.begin() as conn:
        for consumer, event_type, error_class, error in letters:
            conn.execute(
                text(
                    "INSERT INTO pipeline.dead_letters (stage, consumer, event_type, reason,"
                    " error_class, error) VALUES ('consume', :c, :t, 'gave up', :k, :e)"
                ),
                {"c": consumer, "t": event_type, "k": error_class, "e": error},
            )
    groups = dlq_json(dlq_settings, "groups")
    found = {(g["consumer"], g["event_type"], g["error_class"], g["message"]): g for g in groups}
    assert {key: g["count"] for key, g in found.items()} == {
        ("payments", "order.placed", "Timeout", "upstream <hex> after <n> s"): 4,
        ("payments", "order.placed", "KeyError", "<str> in <hex>"): 2,
        ("payments", "order.placed", "KeyError", "<uuid> in <hex>"): 1,
        ("audit", "order.placed", "Timeout", "upstream <hex> after <n> s"): 1,
        ("payments", "order.paid", "Timeout", "upstream <hex> after <n> s"): 1,
        ("payments", "order.placed", "Slow", "upstream <hex> after <n> s"): 1,
    }
    assert len({g["fingerprint"] for g in groups}) == 6
    timeouts = found[("payments", "order.placed", "Timeout", "upstream <hex> after <n> s")]
    assert timeouts["sample_error"] == "Timeout: upstream 0x1f3a after 30.5 s"  # the oldest
    members = dlq_json(dlq_settings, "list", "--group", timeouts["fingerprint"])
    assert [d["error"] for d in members] == [e for _, _, _, e in letters[:4]]
    scoped = dlq_json(dlq_settings, "groups", "--error-class", "KeyError", "--limit", "1")
    assert [g["count"] for g in scoped] == [2]


SECRETS = ("hunter2-pw", "sk-live-4f9a2c")
MASKED_URL = "https://charger:***@api.example/v1/charge?order=o7&api_key=***"


def assert_masked(output: str) -> None:
    """No secret of the charge URL in ``output``; the URL itself, masked, is there."""
    for secret in SECRETS:
        assert secret not in output, output
    assert MASKED_URL in output, output


def test_errors_quoting_a_url_are_shown_without_its_secrets(engine, dlq_settings):
    """A dead letter (and its attempt) stored with the raw URL, as any writer of the table
    may have stored it: list, groups, show and trace mask it, in text and JSON."""
    from tests.apps import dlq_app  # here, not at collection: see tests/conftest.py

    (event_id,) = produce(engine, [NewEvent("order.placed", {"order_id": "u1"})])
    raw = f"HTTPStatusError: Client error '401 Unauthorized' for url '{dlq_app.CHARGE_URL}'"
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO pipeline.attempts (event_id, stage, consumer, attempt, error_class,"
                " error) VALUES (:e, 'consume', 'payments', 1, 'HTTPStatusError', :r)"
            ),
            {"e": event_id, "r": raw},
        )
        letter_id = conn.execute(
            text(
                "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, event_type, queue,"
                " reason, error_class, error, attempts) VALUES ('consume', :e, 'payments',"
                " 'order.placed', 'pipeline.payments', 'gave up after 1 attempt',"
                " 'HTTPStatusError', :r, 1) RETURNING id"
            ),
            {"e": event_id, "r": raw},
        ).scalar()
    shown = dlq(dlq_settings, "show", str(letter_id))
    assert shown.returncode == 0, shown.stderr
    assert_masked(shown.stdout)
    assert shown.stdout.count("401 Unauthorized") == 2  # the error and its attempt
    detail = dlq_json(dlq_settings, "show", str(letter_id))
    assert detail["error"] == raw.replace(dlq_app.CHARGE_URL, MASKED_URL)
    assert [a["error"] for a in detail["history"]] == [detail["error"]]
    (listed,) = dlq_json(dlq_settings, "list")
    assert listed["error"] == detail["error"]
    (group,) = dlq_json(dlq_settings, "groups")
    assert_masked(group["sample_error"])
    for secret in SECRETS:
        assert secret not in group["message"], group["message"]
    for command in ("list", "groups"):
        result = dlq(dlq_settings, command)
        assert result.returncode == 0, result.stderr
        for secret in SECRETS:
            assert secret not in result.stdout, result.stdout
    assert MASKED_URL in dlq(dlq_settings, "groups").stdout  # the sample line
    # pipeline trace reads the same rows (its attempts, its dead letter's error class)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE pipeline.outbox SET last_error = :r WHERE id = :e"),
            {"e": event_id, "r": raw},
        )
    for args in (["trace", str(event_id)], ["trace", str(event_id), "--json"]):
        traced = run_cli(args, pipeline_env(dlq_settings, APP))
        assert traced.returncode == 0, traced.stderr
        for secret in SECRETS:
            assert secret not in traced.stdout, traced.stdout
    assert MASKED_URL in traced.stdout  # the JSON shows the attempt's error, masked


def test_a_handler_error_quoting_a_url_is_stored_and_sandboxed_without_its_secrets(
    engine, dlq_settings
):
    """The worker stores the handler's error masked; the sandbox reports it masked."""
    with running_pipeline(dlq_settings, APP, threads=1):
        produce(engine, [NewEvent("order.placed", {"order_id": "u2", "unauthorized": True})])
        wait_until(
            lambda: rows(engine, "SELECT count(*) FROM pipeline.dead_letters")[0][0] == 1,
            timeout=60,
        )
    stored = rows(engine, "SELECT error FROM pipeline.dead_letters")
    stored += rows(engine, "SELECT error FROM pipeline.attempts")
    assert stored and all(MASKED_URL in error for (error,) in stored), stored
    assert all(secret not in str(stored) for secret in SECRETS), stored

    report = dlq(dlq_settings, "replay", "--to-sandbox", "--reason", "check", "--json")
    assert report.returncode == 1, report.stderr  # the handler still fails
    (run,) = json.loads(report.stdout)["runs"]
    (outcome,) = run["results"]
    assert outcome["error_class"] == "CardDeclined"
    assert (
        outcome["error"] == f"CardDeclined: Client error '401 Unauthorized' for url '{MASKED_URL}'"
    )
    text_report = dlq(dlq_settings, "replay", "--to-sandbox", "--reason", "check")
    assert text_report.returncode == 1, text_report.stderr
    assert_masked(text_report.stdout)
