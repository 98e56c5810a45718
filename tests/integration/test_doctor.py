"""`pipeline doctor` against real servers: a healthy deployment, and each misconfiguration
seeded on purpose (Redis eviction policy, short inbox retention, a missing index, a LISTEN
URL behind a transaction-pooling PgBouncer, dead letters, clock skew).

The command runs in this process (click's ``CliRunner``: the same exit codes and output),
the healthy deployment's relay and worker too; the healthy report is read once more from
``pipeline doctor`` as a child process, end to end."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from pipeline.config import Settings
from pipeline.tools.harness.embedded import EmbeddedRedis
from pipeline.tools.ops.doctor import Report, run_doctor
from tests.support import pipeline_env, run_cli, run_cli_process, running_pipeline, wait_until

APP = "tests.apps.relay_app"


@pytest.fixture
def doctor_settings(settings: Settings, private_redis: EmbeddedRedis) -> Settings:
    """This test's database, and a Redis of its own (the tests change its configuration)."""
    return settings.replace(redis_url=private_redis.url)


def doctor_cli(settings: Settings, **env: str) -> tuple[int, dict[str, object], str]:
    """``pipeline doctor --json`` in this process: exit code, report, what it logged."""
    result = run_cli(["doctor", "--json"], pipeline_env(settings, APP, **env))
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


def problems(report: dict[str, object]) -> dict[str, list[dict[str, str]]]:
    found: dict[str, list[dict[str, str]]] = {}
    for finding in report["findings"]:  # type: ignore[union-attr]
        if finding["status"] == "problem":
            found.setdefault(finding["check"], []).append(finding)
    return found


def test_healthy_deployment_exits_zero(doctor_settings):
    settings = doctor_settings.replace(canary_interval=1.0)
    url = settings.require_database_url()

    def canary_arrived() -> bool:
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pipeline.inbox WHERE consumer = 'pipeline_canary' "
                "AND status = 'processed'"
            ).fetchone()
        return bool(row and row[0])

    with running_pipeline(settings, APP, threads=2, mode="inline"):
        wait_until(canary_arrived, timeout=90, interval=0.3)
        code, report, _ = doctor_cli(settings)
        text = run_cli_process(["doctor"], pipeline_env(settings, APP))
    assert problems(report) == {}
    assert code == 0 and report["healthy"] is True
    statuses = {f["check"]: f["status"] for f in report["findings"]}
    for check in (
        "schema",
        "indexes",
        "triggers",
        "dead_letters",
        "canary",
        "clock",
        "notify_queue",
        "listen",
        "redis",
        "redis_eviction",
        "inbox_retention",
        "lease",
    ):
        assert statuses[check] == "ok", check
    assert statuses["redis_persistence"] == "info"
    persistence = next(f for f in report["findings"] if f["check"] == "redis_persistence")
    assert "no persistence" in persistence["summary"]
    assert "only delays them" in persistence["summary"]
    assert text.returncode == 0
    assert text.stdout.splitlines()[0] == "pipeline doctor: healthy"


def test_eviction_policy_short_retention_and_dead_letters_are_flagged(
    doctor_settings, private_redis
):
    client = redis.Redis.from_url(private_redis.url)
    try:
        client.config_set("maxmemory-policy", "allkeys-lru")
    finally:
        client.close()
    with psycopg.connect(doctor_settings.require_database_url(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pipeline.dead_letters (stage, reason, error_class, error) "
            "VALUES ('publish', 'gave up', 'Boom', 'boom')"
        )
    code, report, _ = doctor_cli(doctor_settings, PIPELINE_INBOX_RETENTION_SECONDS="100")
    found = problems(report)
    assert code == 1 and report["healthy"] is False
    assert set(found) == {"redis_eviction", "inbox_retention", "dead_letters"}
    (eviction,) = found["redis_eviction"]
    assert eviction["summary"].startswith("maxmemory-policy is 'allkeys-lru'")
    assert eviction["fix"].startswith("CONFIG SET maxmemory-policy noeviction")
    (retention,) = found["inbox_retention"]
    assert (
        "PIPELINE_INBOX_RETENTION_SECONDS=100 is shorter than the retry horizon"
        in (retention["summary"])
    )
    assert retention["fix"].startswith("set PIPELINE_INBOX_RETENTION_SECONDS to at least 540")
    (dead,) = found["dead_letters"]
    assert dead["summary"] == "1 dead letters waiting (1 at publish)"


def test_missing_index_is_flagged_and_its_fix_restores_it(doctor_settings):
    url = doctor_settings.require_database_url()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP INDEX pipeline.inbox_owed_idx")
    code, report, _ = doctor_cli(doctor_settings)
    assert code == 1
    (missing,) = problems(report)["indexes"]
    assert missing["summary"] == "index inbox_owed_idx is missing"
    assert missing["fix"] == (
        "CREATE INDEX CONCURRENTLY inbox_owed_idx ON pipeline.inbox (delivered_at) "
        "WHERE status IN ('pending', 'failed')"
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(missing["fix"])
    code, report, _ = doctor_cli(doctor_settings)
    assert "indexes" not in problems(report)


def test_missing_trigger_and_clock_skew_are_flagged(doctor_settings):
    url = doctor_settings.require_database_url()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TRIGGER outbox_notify ON pipeline.outbox")
    report: Report = run_doctor(doctor_settings, [], clock=lambda: time.time() - 5.0)
    found = {f.check: f for f in report.findings if f.status == "problem"}
    assert found["triggers"].summary == "trigger outbox_notify on outbox is missing"
    assert "`pipeline db upgrade` re-applies functions.sql" in found["triggers"].fix
    assert found["clock"].summary.startswith("this host's clock is 5.0s behind the database's")
    assert not report.healthy


# -- a LISTEN URL behind PgBouncer in transaction pooling --------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def pgbouncer(doctor_settings: Settings, tmp_path: Path) -> Iterator[str]:
    """A PgBouncer in transaction pooling in front of this test's database; yields its URL."""
    binary = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
    )
    if binary is None:
        pytest.skip("pgbouncer not installed (apt-get install pgbouncer)")
    info = psycopg.conninfo.conninfo_to_dict(doctor_settings.require_database_url())
    port = _free_port()
    # Outside pytest's private temporary directory: PgBouncer may run as another user.
    folder = Path(tempfile.mkdtemp(prefix="pipeline-pgbouncer-"))
    folder.chmod(0o755)
    (folder / "users.txt").write_text(f'"{info.get("user", "postgres")}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={info.get('host', '127.0.0.1')} port={info.get('port', 5432)}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\n"
        "ignore_startup_parameters = extra_float_digits\n"
    )
    command = [binary, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        for path in folder.iterdir():
            path.chmod(0o644)
        command = ["runuser", "-u", "nobody", "--", *command]
    log = (tmp_path / "pgbouncer.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"postgresql://{info.get('user', 'postgres')}@127.0.0.1:{port}/{info['dbname']}"

    def up() -> bool:
        assert process.poll() is None, (tmp_path / "pgbouncer.log").read_text()
        try:
            psycopg.connect(url, connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    try:
        wait_until(up, timeout=30, interval=0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def test_listen_url_behind_a_transaction_pooler_is_flagged(doctor_settings, pgbouncer):
    pooled = doctor_settings.replace(database_url=pgbouncer)
    code, report, _ = doctor_cli(pooled)
    assert code == 1
    (listen,) = problems(report)["listen"]
    assert "did not reach a LISTEN within 2s" in listen["summary"]
    assert "transaction pooler" in listen["summary"]
    assert listen["fix"].startswith("point the relay's PIPELINE_DATABASE_URL at Postgres directly")
    pooler = next(f for f in report["findings"] if f["check"] == "pooler")
    assert pooler["status"] == "info"
    assert "a connection pooler sits between this host and Postgres" in pooler["summary"]
    # Everything else still reads through the pooler.
    assert {f["check"]: f["status"] for f in report["findings"]}["schema"] == "ok"


def test_doctor_reports_the_sentinel_quorum_and_each_replica():
    """Behind Sentinel: the quorum is met while the sentinels answer, a problem once too
    few do; the replica is listed with its link and how far behind the master it is."""
    from pipeline.config import load_settings
    from pipeline.tools.harness.sentinel import SentinelSet
    from pipeline.transport.redis.health import diagnose

    with SentinelSet() as sentinels:
        settings = load_settings(redis_url=sentinels.url, message_key="insecure")
        found = {f.check: f for f in diagnose(settings).findings}
        assert found["redis_sentinel"].status == "ok", found["redis_sentinel"]
        assert "3 of 3 listed sentinels answer" in found["redis_sentinel"].summary
        assert found["redis_replicas"].status == "ok"
        assert "link ok" in found["redis_replicas"].summary
        assert "bytes behind" in found["redis_replicas"].summary
        sentinels.sentinels[0].kill()
        sentinels.sentinels[1].kill()
        found = {f.check: f for f in diagnose(settings).findings}
        assert found["redis_sentinel"].status == "problem"
        assert "1 of 3 listed sentinels answer" in found["redis_sentinel"].summary
