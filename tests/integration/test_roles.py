"""Least-privilege roles: the SQL in docs/security.md is what these tests run.

Each test gets a fresh database with the page's hardening applied (no CONNECT or TEMP
for PUBLIC), an owner that installs the schema with ``pipeline db upgrade`` (in process),
and the page's roles under a name prefix of its own (roles are cluster-wide on a
shared server; they are dropped afterwards). Then each role works with exactly its
grants, and without any one of them fails with one clear line.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from pipeline import NewEvent, PermissionDeniedError, Settings, add_event, add_events, configure
from pipeline.db.privileges import dlq_grants, missing_privileges, relay_grants, worker_grants
from pipeline.errors import EventValidationError, ServiceUnavailableError
from pipeline.outbox import stored_size
from pipeline.tools.cli import main as cli_main
from tests.conftest import create_database, drop_database
from tests.support import (
    ROOT,
    Ran,
    app_in_global_registry,
    cli_argv,
    pipeline_env,
    run_cli,
    run_cli_process,
    start_process,
    stop_process,
    wait_until,
    worker_argv,
)

DOC = ROOT / "docs" / "security.md"
APP = "tests.apps.roles_app"
ROLES = ("owner", "producer", "relay", "worker", "operator", "dlq")
STATEMENT = re.compile(
    r"GRANT\s+(?P<privileges>[A-Z][A-Z, ]*?)\s+ON\s+(?P<target>.+?)\s+TO\s+(?P<role>\w+)\s*;", re.S
)
APP_TABLE = """
CREATE TABLE public.role_effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, consumer text NOT NULL,
    event_id uuid NOT NULL,
    UNIQUE (consumer, event_id)
);
"""


# -- the page's SQL ----------------------------------------------------------------------------


def sql_blocks() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(), re.S)


def block_for(role: str) -> str:
    (block,) = [b for b in sql_blocks() if f"CREATE ROLE pipeline_{role} " in b]
    return block


def hardening_block() -> str:
    (block,) = [b for b in sql_blocks() if "REVOKE ALL ON DATABASE" in b]
    return block


def documented_grants(role: str) -> list[tuple[str, str]]:
    """(privilege, object) of every GRANT in the role's block: ``("UPDATE", "pipeline.outbox")``,
    ``("USAGE", "SCHEMA pipeline")``, ``("CONNECT", "DATABASE app")``."""
    grants = []
    for match in STATEMENT.finditer(block_for(role)):
        assert match["role"] == f"pipeline_{role}", match.group(0)
        target = " ".join(match["target"].split())
        objects = (
            [target]
            if target.startswith(("SCHEMA ", "DATABASE "))
            else [name.strip() for name in target.split(",")]
        )
        privileges = [p.strip() for p in match["privileges"].split(",")]
        grants += [(privilege, name) for privilege in privileges for name in objects]
    return grants


def documented_table_grants(role: str) -> set[tuple[str, str]]:
    return {(p, name) for p, name in documented_grants(role) if name.startswith("pipeline.")}


def code_grants(grants: dict[str, frozenset[str]]) -> set[tuple[str, str]]:
    return {(p, f"pipeline.{table}") for table, privileges in grants.items() for p in privileges}


# -- a database with the page's roles ----------------------------------------------------------


def _with(url: str, *, user: str | None = None, dbname: str | None = None) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}@{host}:{parts.port or 5432}" if user else parts.netloc
    return urlunsplit(parts._replace(netloc=netloc, path=f"/{dbname}" if dbname else parts.path))


@dataclass
class Deployment:
    server_url: str
    database: str
    prefix: str
    redis_url: str
    redis_namespace: str

    def role(self, name: str) -> str:
        return f"{self.prefix}pipeline_{name}"

    @property
    def admin_url(self) -> str:
        return _with(self.server_url, dbname=self.database)

    def url(self, name: str) -> str:
        return _with(self.server_url, user=self.role(name), dbname=self.database)

    def render(self, text: str) -> str:
        """The page's SQL for this test: its database and prefixed role names."""
        text = re.sub(
            r"\bpipeline_(?:owner|producer|relay|worker|operator|dlq)\b",
            self.prefix + r"\g<0>",
            text,
        )
        return re.sub(r"\bDATABASE app\b", f'DATABASE "{self.database}"', text)

    def admin(self, statement: str, params: dict[str, object] | None = None) -> list[tuple]:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def settings(self, name: str, **changes: object) -> Settings:
        values: dict[str, object] = {
            "database_url": self.url(name),
            "redis_url": self.redis_url,
            "redis_namespace": self.redis_namespace,
            "canary_interval": 0,
            "lease_seconds": 3.0,
            "poll_interval_max": 0.5,
            "broker_heartbeat_timeout_ms": 3000,
            "broker_maintenance_chance": 200_000,
        }
        values.update(changes)
        return Settings(**values)  # type: ignore[arg-type]

    def env(self, name: str, **extra: str) -> dict[str, str]:
        return pipeline_env(
            self.settings(name),
            APP,
            PIPELINE_METRICS_PORT="0",
            PIPELINE_WORKER_METRICS_PORT="0",
            # unsigned on purpose unless a test says otherwise: no warning line at start
            **{"PIPELINE_MESSAGE_KEY": "insecure", **extra},
        )


@pytest.fixture
def deployment(
    postgres_server_url: str, redis_server_url: str, redis_namespace: str
) -> Iterator[Deployment]:
    name, _ = create_database(postgres_server_url)
    setup = Deployment(
        postgres_server_url, name, f"t{uuid.uuid4().hex[:10]}_", redis_server_url, redis_namespace
    )
    try:
        setup.admin(setup.render(hardening_block()))
        setup.admin(setup.render(block_for("owner")))
        upgrade = run_cli(["db", "upgrade"], setup.env("owner"))  # in this process
        assert upgrade.returncode == 0, upgrade.stderr
        for role in ROLES[1:]:
            setup.admin(setup.render(block_for(role)))
        setup.admin(APP_TABLE)
        setup.admin(f"GRANT SELECT, INSERT ON public.role_effects TO {setup.role('worker')}")
        yield setup
    finally:
        configure(None)
        drop_database(postgres_server_url, name)
        with psycopg.connect(postgres_server_url, autocommit=True) as conn:
            for role in ROLES:
                conn.execute(
                    sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(setup.role(role)))
                )


def count(setup: Deployment, query: str, **params: object) -> int:
    return int(setup.admin(query, params)[0][0])


# -- the page and the code agree ---------------------------------------------------------------


def test_the_documented_grants_are_exactly_what_relays_and_workers_check():
    assert documented_table_grants("relay") == code_grants(
        relay_grants(publishing=True, canary=True)
    )
    assert documented_table_grants("worker") == code_grants(worker_grants(publishing=True))
    assert documented_table_grants("producer") == {("INSERT", "pipeline.outbox")}
    assert {p for p, _ in documented_table_grants("operator")} == {"SELECT"}
    assert documented_table_grants("dlq") == code_grants(
        dlq_grants(replay=True, purge=True, abandon=True)
    )
    for role in ROLES:
        assert ("CONNECT", "DATABASE app") in documented_grants(role)


def test_the_owner_owns_everything_and_only_the_triggers_run_with_its_rights(deployment):
    owners = deployment.admin(
        "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'pipeline'"
    )
    assert owners == [(deployment.role("owner"),)]
    functions = deployment.admin(
        "SELECT p.proname, p.prosecdef, p.proconfig, pg_get_userbyid(p.proowner) "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'pipeline' ORDER BY p.proname"
    )
    owner = deployment.role("owner")
    path = "search_path=pipeline, pg_temp"  # pg_temp last: no temporary table shadows a table
    assert [(name, definer, path in config, by) for name, definer, config, by in functions] == [
        ("claim_outbox", False, True, owner),
        ("notify_outbox", True, True, owner),
        ("refuse_oversize_payload", False, True, owner),
        ("sequence_ordered_event", True, True, owner),
    ]


# -- the producer ------------------------------------------------------------------------------


def test_the_producer_adds_events_and_can_do_nothing_else(deployment):
    settings = deployment.settings("producer")
    configure(settings)
    engine = create_engine(settings.sqlalchemy_url())
    with psycopg.connect(deployment.admin_url, autocommit=True) as listener:
        listener.execute("LISTEN pipeline_outbox")
        with Session(engine) as session, session.begin():
            ordered = add_event(
                session, "role.order", {"order": "o1"}, aggregate_type="order", aggregate_id="o1"
            )
            unordered = add_events(
                session, [NewEvent("role.order", {"order": "o2"}, ordered=False)]
            )[0]
        notified = list(listener.notifies(timeout=5, stop_after=1))
    engine.dispose()
    assert [n.channel for n in notified] == ["pipeline_outbox"]  # the NOTIFY trigger ran
    rows = dict(deployment.admin("SELECT id, ordering_key FROM pipeline.outbox ORDER BY seq"))
    assert rows == {ordered: "order:o1", unordered: None}  # the sequencing trigger ran

    forbidden = [
        "SELECT payload FROM pipeline.outbox",
        "UPDATE pipeline.outbox SET status = 'sent'",
        "DELETE FROM pipeline.outbox",
        "SELECT * FROM pipeline.inbox",
        "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status) "
        "VALUES ('x', gen_random_uuid(), 't', 'processed')",
        "SELECT * FROM pipeline.relay_state",
        "SELECT * FROM pipeline.dead_letters",
        "SELECT * FROM pipeline.claim_outbox('pipeline', 10, 10, 10, 1, 'me', 30)",
        "CREATE TEMP TABLE relay_state (busy boolean)",
    ]
    with psycopg.connect(deployment.url("producer"), autocommit=True) as conn:
        for statement in forbidden:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    assert count(deployment, "SELECT count(*) FROM pipeline.outbox WHERE status = 'pending'") == 2


def padded(shape: dict[str, object], size: int) -> dict[str, object]:
    """``shape`` plus a string member that makes it exactly ``size`` bytes as add_event
    measures a payload (compact JSON, numbers as Postgres prints them)."""
    base = {**shape, "pad": ""}
    encoded = json.dumps(base, separators=(",", ":"), ensure_ascii=False)
    return {**shape, "pad": "x" * (size - stored_size(base, encoded, len(encoded.encode())))}


# A payload whose jsonb text (a space after each ',' and ':') is far longer than its compact
# JSON, with members whose value is null, numbers, escapes and text that looks like JSON.
STRUCTURED = {
    "rows": [{"id": i, "note": None, "tags": ["a", None]} for i in range(6000)],
    "text": 'say ": null", then {"a": 1, "b": [2, 3]}\n\t\u0001 é €',
    "numbers": [0.5, -0.0, 1e-05, 12345678901234567890],
}


def test_the_outbox_refuses_exactly_what_add_event_refuses_whoever_inserts_it(deployment):
    settings = deployment.settings("producer")
    configure(settings)
    limit = settings.max_payload_bytes
    assert limit == 256 * 1024
    engine = create_engine(settings.sqlalchemy_url())
    for shape in ({}, STRUCTURED):
        with Session(engine) as session, session.begin():
            add_event(session, "role.big", padded(shape, limit))
        with pytest.raises(EventValidationError, match=f"over the limit of {limit}"):
            with Session(engine) as session, session.begin():
                add_event(session, "role.big", padded(shape, limit + 1))
    engine.dispose()

    insert = "INSERT INTO pipeline.outbox (id, event_type, payload) VALUES (%s, 'role.big', {})"
    refused = [
        (insert.format("%s"), Jsonb(padded({}, limit + 1))),
        (insert.format("%s"), Jsonb(padded(STRUCTURED, limit + 1))),
        (insert.format("%s"), Jsonb({"blob": "x" * 300_000})),  # compresses to ~4 KiB
        (insert.format("jsonb_build_object('blob', repeat('x', %s))"), 300_000),
        (insert.format("(SELECT jsonb_agg(%s::numeric) FROM generate_series(1, 3))"), "1e131000"),
    ]
    with psycopg.connect(deployment.url("producer"), autocommit=True) as conn:
        for statement, value in refused:
            with pytest.raises(psycopg.errors.CheckViolation) as raised:
                conn.execute(statement, (uuid.uuid4(), value))
            assert raised.value.diag.constraint_name == "outbox_payload_size_check"
            assert raised.value.diag.table_name == "outbox"
            assert "bytes of compact JSON, over the limit of 262144" in str(raised.value)
        for shape in ({}, STRUCTURED):
            conn.execute(insert.format("%s"), (uuid.uuid4(), Jsonb(padded(shape, limit))))
    sizes = deployment.admin(
        "SELECT octet_length(payload::text) > %(limit)s FROM pipeline.outbox ORDER BY seq",
        {"limit": limit},
    )
    assert sizes == [(True,)] * 4  # each one measured exactly: its text is over the limit


def test_without_definer_triggers_the_producer_could_not_add_an_ordered_event(deployment):
    deployment.admin("ALTER FUNCTION pipeline.sequence_ordered_event() SECURITY INVOKER")
    configure(deployment.settings("producer"))
    engine = create_engine(deployment.settings("producer").sqlalchemy_url())
    try:
        with pytest.raises(
            PermissionDeniedError, match="permission denied for sequence outbox_seq"
        ):
            with Session(engine) as session, session.begin():
                add_event(session, "role.order", {"order": "o1"}, aggregate_id="o1")
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("revoke", "message"),
    [
        (
            "REVOKE INSERT ON pipeline.outbox FROM pipeline_producer",
            "permission denied for table outbox: adding events needs USAGE on schema pipeline "
            "and INSERT on pipeline.outbox (see docs/security.md)",
        ),
        (
            "REVOKE USAGE ON SCHEMA pipeline FROM pipeline_producer",
            "permission denied for schema pipeline: adding events needs USAGE on schema pipeline "
            "and INSERT on pipeline.outbox (see docs/security.md)",
        ),
    ],
    ids=["insert", "usage"],
)
def test_a_producer_without_its_grant_gets_one_clear_error(deployment, revoke, message):
    deployment.admin(deployment.render(revoke))
    settings = deployment.settings("producer")
    configure(settings)
    engine = create_engine(settings.sqlalchemy_url())
    try:
        with Session(engine) as session, session.begin():
            with pytest.raises(PermissionDeniedError) as raised:
                add_event(session, "role.order", {"order": "o1"})
            session.rollback()
    finally:
        engine.dispose()
    assert str(raised.value) == message


# -- relay and worker --------------------------------------------------------------------------


def produce(setup: Deployment, events: list[NewEvent]) -> list[uuid.UUID]:
    settings = setup.settings("producer")
    configure(settings)
    engine = create_engine(settings.sqlalchemy_url())
    try:
        with Session(engine) as session, session.begin():
            return add_events(session, events)
    finally:
        engine.dispose()


def orders(names: list[str], **data: object) -> list[NewEvent]:
    return [
        NewEvent("role.order", {"order": name, **data}, aggregate_type="order", aggregate_id=name)
        for name in names
    ]


def effects(setup: Deployment, consumer: str) -> int:
    return count(
        setup, "SELECT count(*) FROM public.role_effects WHERE consumer = %(c)s", c=consumer
    )


def test_relay_and_worker_processes_deliver_with_only_their_grants(deployment, tmp_path):
    worker = start_process(
        worker_argv(1, 4),
        deployment.env("worker"),
        tmp_path / "worker.log",
    )
    # first the workers publish (publishing actors), then the relay itself, with the canary
    relay = start_process(
        cli_argv("relay", "--mode", "workers"),
        deployment.env("relay"),
        tmp_path / "relay-workers.log",
    )
    logs = [tmp_path / "worker.log", tmp_path / "relay-workers.log", tmp_path / "relay-auto.log"]
    try:
        produce(deployment, orders(["o1", "o3", "o4", "o5"]) + orders(["o2"], fail_once=True))
        produce(deployment, orders(["p1"], poison=True))
        wait_until(lambda: effects(deployment, "role_shipping") == 5, timeout=60)
        stop_process(relay)
        relay = start_process(
            cli_argv("relay"),
            deployment.env("relay", PIPELINE_CANARY_INTERVAL="0.5"),
            tmp_path / "relay-auto.log",
        )
        produce(deployment, orders([f"o{i}" for i in range(6, 11)]))
        wait_until(lambda: effects(deployment, "role_shipping") == 10, timeout=60)
        wait_until(
            lambda: count(
                deployment,
                "SELECT count(*) FROM pipeline.inbox "
                "WHERE consumer = 'pipeline_canary' AND status = 'processed'",
            ),
            timeout=30,
        )
    finally:
        stop_process(relay)
        stop_process(worker)
    assert effects(deployment, "role_orders") == 10
    dead = deployment.admin("SELECT stage, consumer, error_class FROM pipeline.dead_letters")
    assert dead == [("consume", "role_orders", "Poison")]
    attempts = deployment.admin(
        "SELECT consumer, error_class FROM pipeline.attempts ORDER BY error_class"
    )
    assert attempts == [("role_orders", "FirstTry"), ("role_orders", "Poison")]
    assert count(deployment, "SELECT count(*) FROM pipeline.outbox WHERE status <> 'sent'") == 0
    for log in logs:
        text = log.read_text()
        assert "Traceback" not in text and "permission denied" not in text, (log, text[-3000:])


def test_every_documented_relay_and_worker_grant_is_checked_at_start_up(deployment):
    needs = {
        "relay": relay_grants(publishing=True, canary=True),
        "worker": worker_grants(publishing=True),
    }
    for role, grants in needs.items():
        with psycopg.connect(deployment.url(role), autocommit=True) as conn:
            assert missing_privileges(conn, "pipeline", grants) == ("", [])
        for privilege, name in documented_grants(role):
            deployment.admin(
                deployment.render(f"REVOKE {privilege} ON {name} FROM pipeline_{role}")
            )
            try:
                if name.startswith("DATABASE "):
                    with pytest.raises(ServiceUnavailableError, match="CONNECT privilege"):
                        from pipeline.db.connect import connect

                        connect(deployment.settings(role)).close()
                    continue
                expected = (
                    "USAGE on schema pipeline"
                    if name == "SCHEMA pipeline"
                    else f"{privilege} on {name}"
                )
                with psycopg.connect(deployment.url(role), autocommit=True) as conn:
                    who, missing = missing_privileges(conn, "pipeline", grants)
                assert (who, missing) == (deployment.role(role), [expected]), (
                    role,
                    privilege,
                    name,
                )
            finally:
                deployment.admin(
                    deployment.render(f"GRANT {privilege} ON {name} TO pipeline_{role}")
                )


def assert_one_line(result: Ran, line: str) -> None:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert "Traceback" not in output
    assert output.splitlines() == [line]


def test_a_relay_without_update_on_the_outbox_refuses_to_start(deployment):
    deployment.admin(deployment.render("REVOKE UPDATE ON pipeline.outbox FROM pipeline_relay"))
    result = run_cli_process(["relay"], deployment.env("relay"))
    assert_one_line(
        result,
        f"pipeline: error: permission denied: the database role {deployment.role('relay')!r} "
        "lacks UPDATE on pipeline.outbox, which `pipeline relay` needs (the grants are in "
        "docs/security.md)",
    )


def test_a_worker_without_insert_on_the_inbox_or_attempts_refuses_to_start(deployment):
    deployment.admin(deployment.render("REVOKE INSERT ON pipeline.inbox FROM pipeline_worker"))
    deployment.admin(deployment.render("REVOKE INSERT ON pipeline.attempts FROM pipeline_worker"))
    result = run_cli_process(["worker"], deployment.env("worker"))
    assert_one_line(
        result,
        f"pipeline: error: permission denied: the database role {deployment.role('worker')!r} "
        "lacks INSERT on pipeline.attempts, INSERT on pipeline.inbox, which `pipeline worker` "
        "needs (the grants are in docs/security.md)",
    )


def test_a_worker_that_does_not_publish_needs_no_publishing_grants(deployment):
    for grant in (
        "UPDATE ON pipeline.outbox",
        "SELECT ON pipeline.outbox",
        "SELECT ON pipeline.dead_letters",
    ):
        deployment.admin(deployment.render(f"REVOKE {grant} FROM pipeline_worker"))
    with psycopg.connect(deployment.url("worker"), autocommit=True) as conn:
        assert missing_privileges(conn, "pipeline", worker_grants(publishing=False)) == ("", [])
        _, missing = missing_privileges(conn, "pipeline", worker_grants(publishing=True))
    assert missing == [
        "SELECT on pipeline.dead_letters",
        "SELECT on pipeline.outbox",
        "UPDATE on pipeline.outbox",
    ]


def test_a_relay_whose_grant_is_revoked_while_it_runs_stops_with_one_line(deployment, tmp_path):
    log = tmp_path / "relay.log"
    relay = start_process(cli_argv("relay"), deployment.env("relay"), log)
    try:
        wait_until(lambda: "relay started" in log.read_text(), timeout=30)
        deployment.admin(deployment.render("REVOKE UPDATE ON pipeline.outbox FROM pipeline_relay"))
        produce(deployment, orders(["o1"]))
        relay.wait(timeout=30)
    finally:
        stop_process(relay)
    text = log.read_text()
    assert relay.returncode == 1, text
    assert "Traceback" not in text
    assert text.strip().splitlines()[-1] == (
        "pipeline: error: permission denied for table outbox: the database role lacks a grant "
        "(see docs/security.md)"
    )


# -- the operator ------------------------------------------------------------------------------


def run_in_process(
    deployment: Deployment, role: str, args: list[str], monkeypatch, capsys
) -> tuple[int, str, str]:
    for name, value in deployment.env(role).items():
        if name.startswith("PIPELINE_"):
            monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited, app_in_global_registry(APP):
        cli_main(args)
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out, captured.err


def test_the_operator_runs_status_trace_and_db_pending(deployment, monkeypatch, capsys):
    (event_id,) = produce(deployment, orders(["o1"]))
    code, out, err = run_in_process(
        deployment, "operator", ["status", "--json"], monkeypatch, capsys
    )
    assert (code, err) == (0, "")
    assert '"pending": 1' in out
    code, out, err = run_in_process(
        deployment, "operator", ["trace", str(event_id), "--json"], monkeypatch, capsys
    )
    assert (code, err) == (0, "") and str(event_id) in out
    code, out, err = run_in_process(deployment, "operator", ["db", "pending"], monkeypatch, capsys)
    assert (code, out.strip(), err) == (0, "no pending migrations", "")
    with psycopg.connect(deployment.url("operator"), autocommit=True) as conn:
        for statement in (
            "UPDATE pipeline.outbox SET status = 'sent'",
            "DELETE FROM pipeline.inbox",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)


READERS = {  # the operator command that reads each table
    "pipeline.outbox": ["status"],
    "pipeline.dead_letters": ["status"],
    "pipeline.relay_state": ["status"],
    "pipeline.worker_state": ["status"],
    "pipeline.delivery_sweep": ["status"],
    "pipeline.delivery_log": ["status"],
    "pipeline.attempts": ["trace", "EVENT"],
    "pipeline.inbox": ["trace", "EVENT"],
    "pipeline.schema_migrations": ["db", "pending"],
    "pipeline.audit_log": ["dlq", "audit"],
}


def test_each_operator_grant_is_needed_and_its_absence_is_one_line(deployment, monkeypatch, capsys):
    (event_id,) = produce(deployment, orders(["o1"]))
    grants = documented_table_grants("operator")
    assert {name for _, name in grants} == set(READERS)
    for _, name in sorted(grants):
        args = [str(event_id) if a == "EVENT" else a for a in READERS[name]]
        deployment.admin(deployment.render(f"REVOKE SELECT ON {name} FROM pipeline_operator"))
        try:
            code, out, err = run_in_process(deployment, "operator", args, monkeypatch, capsys)
        finally:
            deployment.admin(deployment.render(f"GRANT SELECT ON {name} TO pipeline_operator"))
        table = name.split(".", 1)[1]
        assert (code, out) == (1, ""), (name, out, err)
        assert err.splitlines() == [
            f"pipeline: error: permission denied for table {table}: the database role lacks a "
            "grant (see docs/security.md)"
        ], name


def test_the_documented_sql_is_all_run_here():
    """Every ```sql block of the page is one the fixture runs: none is left untested."""
    run = {hardening_block(), *(block_for(role) for role in ROLES)}
    assert set(sql_blocks()) == run


# -- dead letters ------------------------------------------------------------------------------


def dead_letters_of_both_stages(setup: Deployment) -> tuple[uuid.UUID, uuid.UUID]:
    """A consume-stage dead letter (role_orders gave up on c1) and a publish-stage one (p1)."""
    consumed, published = produce(setup, orders(["c1", "p1"]))
    for statement in (
        "UPDATE pipeline.outbox SET status = 'sent', consumers = '{role_orders}' WHERE id = %(c)s",
        "UPDATE pipeline.outbox SET status = 'dead' WHERE id = %(p)s",
        "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status, attempts)"
        " VALUES ('role_orders', %(c)s, 'role.order', 'dead', 1)",
        "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, event_type, queue, reason,"
        " error_class, error) VALUES ('consume', %(c)s, 'role_orders', 'role.order',"
        " 'pipeline.role_orders', 'non-retryable Poison', 'Poison', 'Poison: refused'),"
        " ('publish', %(p)s, NULL, 'role.order', NULL, 'gave up', 'RuntimeError', 'RuntimeError')",
    ):
        setup.admin(statement, {"c": consumed, "p": published})
    return consumed, published


def test_the_dlq_role_replays_purges_and_runs_the_sandbox(deployment, monkeypatch, capsys):
    import json

    consumed, published = dead_letters_of_both_stages(deployment)
    # read-only operators list, show and plan, and cannot act
    for args in (["dlq", "list"], ["dlq", "show", "1"], ["dlq", "replay", "--dry-run"]):
        code, _, err = run_in_process(deployment, "operator", args, monkeypatch, capsys)
        assert (code, err) == (0, ""), args
    code, out, err = run_in_process(
        deployment, "operator", ["dlq", "replay", "--reason", "r"], monkeypatch, capsys
    )
    assert (code, out) == (1, "")
    assert err.startswith("pipeline: error: permission denied: the database role ")
    assert "INSERT on pipeline.audit_log" in err and "UPDATE on pipeline.outbox" in err
    assert "which `pipeline dlq replay` needs" in err and len(err.splitlines()) == 1

    # the sandbox runs the handler with the worker's grants
    deployment.admin(deployment.render("GRANT pipeline_worker TO pipeline_dlq"))
    code, out, err = run_in_process(
        deployment,
        "dlq",
        ["dlq", "replay", "--to-sandbox", "--reason", "r", "--json"],
        monkeypatch,
        capsys,
    )
    assert (code, err) == (0, "")
    (run,) = json.loads(out)["runs"]
    assert [r["outcome"] for r in run["results"]] == ["ok"]
    assert effects(deployment, "role_orders") == 0  # rolled back
    deployment.admin(deployment.render("REVOKE pipeline_worker FROM pipeline_dlq"))

    code, out, err = run_in_process(
        deployment, "dlq", ["dlq", "replay", "--reason", "r", "--json"], monkeypatch, capsys
    )
    assert (code, err) == (0, "")
    assert json.loads(out)["replayed"] == 2
    assert deployment.admin(
        "SELECT status FROM pipeline.inbox WHERE event_id = %(e)s", {"e": consumed}
    ) == [("pending",)]
    assert deployment.admin(
        "SELECT status FROM pipeline.outbox WHERE id = %(e)s", {"e": published}
    ) == [("pending",)]
    code, _, err = run_in_process(
        deployment, "dlq", ["dlq", "purge", "--all", "--reason", "r"], monkeypatch, capsys
    )
    assert (code, err) == (0, "")
    code, out, err = run_in_process(
        deployment, "operator", ["dlq", "audit", "--json"], monkeypatch, capsys
    )
    assert [(a["action"], a["affected"]) for a in json.loads(out)] == [
        ("dlq.purge", 2),
        ("dlq.replay", 2),
        ("dlq.replay.sandbox", 1),
    ]


def test_each_dlq_grant_is_checked_before_anything_changes(deployment, monkeypatch, capsys):
    dead_letters_of_both_stages(deployment)
    before = deployment.admin(
        "SELECT (SELECT count(*) FROM pipeline.audit_log),"
        " (SELECT count(*) FROM pipeline.dead_letters WHERE replayed_at IS NULL)"
    )
    for privilege, name in sorted(documented_table_grants("dlq")):
        # DELETE is a purge's grant, delivery_sweep an abandon's; every other one a
        # replay's (the check comes first)
        action = ["replay"]
        if privilege == "DELETE":
            action = ["purge", "--all"]
        elif name.endswith(".delivery_sweep"):
            action = ["abandon", "--consumer", "retired", "--force", "--yes"]
        command = ["dlq", *action, "--reason", "r"]
        deployment.admin(deployment.render(f"REVOKE {privilege} ON {name} FROM pipeline_dlq"))
        try:
            code, out, err = run_in_process(deployment, "dlq", command, monkeypatch, capsys)
        finally:
            deployment.admin(deployment.render(f"GRANT {privilege} ON {name} TO pipeline_dlq"))
        assert code == 1, (privilege, name, out, err)
        (line,) = err.splitlines()
        assert f"lacks {privilege} on {name}, which `pipeline dlq" in line, line
    after = deployment.admin(
        "SELECT (SELECT count(*) FROM pipeline.audit_log),"
        " (SELECT count(*) FROM pipeline.dead_letters WHERE replayed_at IS NULL)"
    )
    assert after == before
