"""The drill's own throwaway Postgres and Redis, and the server faults only they may take.

The drill restarts, stops or crashes a server only when it started that server itself
(``pipeline.tools.harness.embedded``); a server given with ``--database-url``/``--redis-url`` is
never touched. Its own servers are set up for what the drill does to them:

* Postgres runs with ``fsync`` off: a crash of the Postgres processes (an immediate
  shutdown) then loses nothing, since the WAL is in the operating system's page cache;
  only an operating-system crash would, which the drill does not cause. Commits stay
  synchronous.
* Redis writes an append-only file (``appendfsync always``) between faults, so a restart
  keeps its data unless the fault says otherwise (``volatile``: no persistence).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis
from pipeline.tools.harness.hosts import Host

PostgresStop = Literal["fast", "immediate"]
RedisMode = Literal["always", "everysec", "volatile"]
STOP_SIGNALS = {"fast": signal.SIGINT, "immediate": signal.SIGQUIT}  # pg_ctl stop -m ...
STOP_TIMEOUT = 60.0
REWRITE_TIMEOUT = 60.0


class DrillServerError(RuntimeError):
    """One of the drill's own servers could not be restarted."""


def through_proxy(url: str, port: int) -> str:
    """``url`` with its host and port replaced by 127.0.0.1:``port`` (credentials kept)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def address(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


class _OwnedServer:
    """What the drill's two servers share: where they are, and how the drill lets go."""

    server: EmbeddedPostgres | EmbeddedRedis

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def data_dir(self) -> str:
        return str(self.server.data_dir)

    def start(self) -> None:
        self.server.start()

    def close(self, keep: bool) -> None:
        """Stop the server; unless ``keep``, delete its data too."""
        if keep:
            self.server.stop()
        else:
            self.server.cleanup()


class OwnedPostgres(_OwnedServer):
    """A throwaway Postgres the drill may restart (``-m fast`` or ``-m immediate``)."""

    def __init__(self, host: Host | None = None) -> None:
        self.server: EmbeddedPostgres = EmbeddedPostgres(durable=True, host=host)

    def start(self) -> None:
        self.server.start()
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET fsync = off")
            conn.execute("ALTER SYSTEM SET full_page_writes = off")
            conn.execute("SELECT pg_reload_conf()")

    def restart(self, mode: PostgresStop) -> float:
        """Stop the server as ``pg_ctl stop -m MODE`` does, start it again; seconds down."""
        pid = self.server.pid
        if pid is None:
            raise DrillServerError("the drill's Postgres is not running")
        began = time.monotonic()
        os.kill(pid, STOP_SIGNALS[mode])
        deadline = began + STOP_TIMEOUT
        while self.server.is_running():
            if time.monotonic() > deadline:
                self.server.kill()
                break
            time.sleep(0.02)
        self.server.start()  # crash recovery after an immediate stop; waits until ready
        return time.monotonic() - began


class OwnedRedis(_OwnedServer):
    """A throwaway Redis the drill may crash and restart, with or without persistence."""

    def __init__(self, host: Host | None = None) -> None:
        self.server: EmbeddedRedis = EmbeddedRedis(persistent=True, host=host)

    def prepare(self, mode: RedisMode) -> None:
        """Switch persistence for the coming crash: AOF fsynced always, every second, or none."""
        with self._client() as client:
            if mode == "volatile":
                client.config_set("appendonly", "no")
            else:
                client.config_set("appendfsync", mode)

    def crash(self, mode: RedisMode) -> float:
        """SIGKILL Redis and start it again; with ``volatile`` it comes back empty."""
        began = time.monotonic()
        self.server.kill()
        self.server.persistent = mode != "volatile"
        try:
            self.server.start()
        finally:
            self.server.persistent = True
        down = time.monotonic() - began
        self._persist_again()
        return down

    def down(self, seconds: float) -> float:
        """Shut Redis down cleanly, keep it down for ``seconds``, start it; seconds down."""
        began = time.monotonic()
        self.server.stop()
        time.sleep(seconds)
        self.server.start()
        return time.monotonic() - began

    def _persist_again(self) -> None:
        """Back to the baseline (AOF, fsync always), the file rewritten before anything else."""
        with self._client() as client:
            client.config_set("appendfsync", "always")
            if client.config_get("appendonly").get("appendonly") == "yes":
                return
            client.config_set("appendonly", "yes")  # starts a rewrite of the whole dataset
            deadline = time.monotonic() + REWRITE_TIMEOUT
            while True:
                info = client.info("persistence")
                if (
                    info.get("aof_enabled") == 1
                    and info.get("aof_rewrite_in_progress") == 0
                    and info.get("aof_rewrite_scheduled") == 0
                ):
                    return
                if time.monotonic() > deadline:
                    raise DrillServerError("Redis did not finish rewriting its append-only file")
                time.sleep(0.05)

    def _client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)
