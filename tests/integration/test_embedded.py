"""Real throwaway servers: crash (SIGKILL) and restart must keep committed data."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from pipeline.tools.harness import binaries
from pipeline.tools.harness import server as lifecycle
from pipeline.tools.harness.embedded import (
    BinaryNotFoundError,
    EmbeddedPostgres,
    EmbeddedRedis,
    EmbeddedServerError,
    ServerStartError,
    free_port,
)


@pytest.fixture
def pg() -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres()
    yield server
    server.cleanup()


@pytest.fixture
def occupied_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_postgres_committed_row_survives_kill(pg: EmbeddedPostgres) -> None:
    pg.start()
    port = pg.port
    assert pg.is_running()
    assert pg.url == f"postgresql://postgres@127.0.0.1:{port}/postgres"
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE crash_probe (id int PRIMARY KEY, note text)")
        conn.execute("INSERT INTO crash_probe VALUES (1, 'committed')")
        assert conn.execute("SHOW fsync").fetchone() == ("on",)
        assert conn.execute("SHOW max_connections").fetchone() == ("200",)

    pg.kill()
    assert not pg.is_running()
    pg.start()  # crash recovery replays the WAL

    assert pg.port == port
    with psycopg.connect(pg.url) as conn:
        assert conn.execute("SELECT id, note FROM crash_probe").fetchall() == [(1, "committed")]
    pg.restart()
    with psycopg.connect(pg.dsn("template1")) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("template1",)
    pg.stop()
    assert not pg.is_running()
    assert pg.socket_dir is None


def test_postgres_cleanup_removes_temp_dir() -> None:
    with EmbeddedPostgres(durable=False) as pg:
        data_dir = pg.data_dir
        assert (data_dir / "PG_VERSION").exists()
        assert (data_dir / "postgres.log").exists()
        with psycopg.connect(pg.url) as conn:
            assert conn.execute("SHOW fsync").fetchone() == ("off",)
    assert not pg.is_running()
    assert not data_dir.exists()


def test_postgres_rejects_foreign_data_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a cluster")
    server = EmbeddedPostgres(data_dir=tmp_path)
    with pytest.raises(EmbeddedServerError, match="not a Postgres data directory"):
        server.start()
    assert not server.is_running()
    server.cleanup()
    assert (tmp_path / "notes.txt").exists(), "a caller's directory is never deleted"


def test_postgres_corrupt_data_dir_reports_log_tail(pg: EmbeddedPostgres) -> None:
    pg.start()
    pg.stop()
    (pg.data_dir / "global" / "pg_control").unlink()
    with pytest.raises(ServerStartError, match=r"(?s)exited with code.*pg_control"):
        pg.start()
    assert not pg.is_running()


def test_postgres_start_timeout_kills_server() -> None:
    server = EmbeddedPostgres(start_timeout=0)
    try:
        with pytest.raises(
            ServerStartError, match=r"did not accept connections on 127\.0\.0\.1:\d+ within 0s"
        ):
            server.start()
        assert not server.is_running()
    finally:
        server.cleanup()


def test_postgres_pinned_port_in_use(occupied_port: int) -> None:
    server = EmbeddedPostgres(port=occupied_port)
    try:
        with pytest.raises(ServerStartError, match="Address already in use"):
            server.start()
    finally:
        server.cleanup()


def test_postgres_retries_when_auto_port_was_taken(
    occupied_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([occupied_port])
    real_free_port = lifecycle.free_port
    monkeypatch.setattr(lifecycle, "free_port", lambda: next(ports, None) or real_free_port())
    with EmbeddedPostgres(durable=False) as server:
        assert server.port != occupied_port
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert "Address already in use" in server.log_path.read_text()


def test_postgres_missing_binaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BinaryNotFoundError, match="initdb does not exist"):
        EmbeddedPostgres(bin_dir=tmp_path).start()
    monkeypatch.setattr(binaries, "postgres_bin_candidates", list)
    with pytest.raises(EmbeddedServerError, match="no usable Postgres binaries"):
        EmbeddedPostgres().start()


def test_postgres_falls_back_to_system_binaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binaries, "package_dir", lambda name: None)  # as if no pgserver wheel
    if not binaries.postgres_bin_candidates():
        pytest.skip("no system Postgres installed")
    with EmbeddedPostgres(durable=False) as server:
        assert server.bin_dir is not None
        assert "pgserver" not in str(server.bin_dir)
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_redis_kill_and_restart() -> None:
    with EmbeddedRedis() as server:
        port = server.port
        client = redis.Redis.from_url(server.url)
        client.set("probe", "1")
        server.kill()
        assert not server.is_running()
        server.start()
        assert server.port == port
        assert client.ping()
        assert client.get("probe") is None, "not persistent by default"
        client.close()
        data_dir = server.data_dir
    assert not data_dir.exists()


def test_redis_persistent_survives_kill() -> None:
    with EmbeddedRedis(persistent=True) as server:
        client = redis.Redis.from_url(server.url)
        client.set("probe", "kept")
        server.kill()
        server.restart()
        assert client.get("probe") == b"kept"
        client.close()


def test_redis_retries_when_auto_port_was_taken(
    occupied_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([occupied_port])
    real_free_port = lifecycle.free_port
    monkeypatch.setattr(lifecycle, "free_port", lambda: next(ports, None) or real_free_port())
    with EmbeddedRedis() as server:
        assert server.port != occupied_port
        assert redis.Redis.from_url(server.url).ping()


def test_redis_missing_binary(tmp_path: Path) -> None:
    server = EmbeddedRedis(executable=tmp_path / "redis-server")
    with pytest.raises(BinaryNotFoundError, match="no usable redis-server"):
        server.start()
    server.cleanup()


OWNER_SCRIPT = """
import json, sys, time
from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis
pg, rd = EmbeddedPostgres(durable=False), EmbeddedRedis()
pg.start()
rd.start()
import psycopg
backend = psycopg.connect(pg.url)  # a backend process of the postmaster's own
print(json.dumps({
    "postgres": pg.pid, "redis": rd.pid, "dirs": [str(pg.data_dir), str(rd.data_dir),
    str(pg.socket_dir)], "watchdogs": [pg.watchdog_pid, rd.watchdog_pid],
}), flush=True)
if sys.argv[1] == "exit":
    sys.stdin.readline()  # the test has looked at what runs: go
    sys.exit(0)  # no cleanup(): the watchdogs see their owner go
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _tree(pid: int) -> set[int]:
    """pid and every live process below it."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(
                int(entry.name)
            )
    found, todo = {pid}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _gone_within(pids: set[int], dirs: list[Path], seconds: float) -> tuple[set[int], list[Path]]:
    """What is still there after waiting up to ``seconds`` for it all to go."""
    deadline = time.monotonic() + seconds
    while True:
        left = {pid for pid in pids if _alive(pid)}
        kept = [path for path in dirs if path.exists()]
        if (not left and not kept) or time.monotonic() > deadline:
            return left, kept
        time.sleep(0.1)


@pytest.mark.parametrize("ending", ["sigkill", "exit"])
def test_servers_die_with_their_owner_however_it_ends(ending: str) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, ending],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        started = json.loads(owner.stdout.readline())
        servers = _tree(started["postgres"]) | _tree(started["redis"])
        assert len(servers) >= 4, servers  # postmaster, its backends and helpers, redis
        dirs = [Path(path) for path in started["dirs"]]
        assert all(path.exists() for path in dirs)
        if ending == "sigkill":
            owner.kill()  # no cleanup can run in the owner
        else:
            assert owner.stdin is not None
            owner.stdin.write("\n")  # the owner exits on its own
            owner.stdin.flush()
        owner.wait(timeout=60)
        left, kept = _gone_within(servers | set(started["watchdogs"]), dirs, 30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert not left, f"still running after their owner ended: {sorted(left)}"
    assert not kept, f"left behind: {kept}"


def test_a_clean_cleanup_leaves_the_watchdog_nothing_to_do(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path / "redis")
    server.start()
    watchdog = server.watchdog_pid
    assert watchdog is not None and _alive(watchdog)
    server.cleanup()
    assert not _alive(watchdog)
    assert (tmp_path / "redis").exists(), "a caller's directory is kept"
