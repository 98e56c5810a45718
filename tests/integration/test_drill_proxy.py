"""The drill's fault proxy, as the drill runs it (a child process), in front of real Redis."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.tools.drill.proxy import ProxyProcess
from pipeline.tools.harness.fleet import Fleet


@pytest.fixture
def proxy(redis_server_url: str, tmp_path) -> Iterator[ProxyProcess]:
    target = urlsplit(redis_server_url)
    fleet = Fleet()
    try:
        with (tmp_path / "proxy.log").open("ab") as log:
            value = ProxyProcess.start(
                fleet, target.hostname or "127.0.0.1", target.port or 6379, log
            )
            yield value
            value.close()
    finally:
        fleet.close()
    assert value.process.returncode == 0  # stdin closed: the proxy ends by itself


def client(proxy: ProxyProcess, timeout: float | None = None) -> redis.Redis:
    """A client that reports the first failure instead of retrying it away."""
    return redis.Redis(
        host="127.0.0.1", port=proxy.port, socket_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )


def ping(sock: socket.socket) -> bytes:
    sock.sendall(b"PING\r\n")
    return sock.recv(64)


def test_traffic_passes_through_and_drop_resets_every_connection(proxy):
    first = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    second = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    assert ping(first) == ping(second) == b"+PONG\r\n"

    assert proxy.command("drop") == "dropped 2"

    for sock in (first, second):  # reset: the next read ends at once, with nothing
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(64) == b""
        sock.close()
    assert client(proxy).ping()  # new connections go through again
    stats = json.loads(proxy.command("stats"))
    assert stats["dropped"] == 2 and stats["connections"] == 3


def test_a_stall_holds_traffic_without_closing_connections(proxy):
    stalled = client(proxy, timeout=0.5)
    assert stalled.ping()

    assert proxy.command("stall 3") == "stalled 1"
    with pytest.raises(redis.TimeoutError):
        stalled.execute_command("PING")  # held, not refused

    patient = client(proxy, timeout=30)
    assert patient.ping()  # answered once the stall is over
    assert json.loads(proxy.command("stats"))["stalls"] == 1
    stalled.close()
    patient.close()


def test_an_unknown_command_is_answered_not_fatal(proxy):
    assert proxy.command("reboot") == "error unknown command 'reboot'"
    assert client(proxy).ping()
