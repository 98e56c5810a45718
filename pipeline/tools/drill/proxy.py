"""A TCP proxy that can drop every connection, or stall them all for a while.

The drill puts one in front of Postgres and one in front of Redis, between them and the
relays and workers it starts. ``drop`` aborts every connection at once (both sides see a
reset, as after a network partition or a load balancer restart); ``stall`` stops
forwarding in both directions and holds new connections unanswered until it ends, as a
congested or partitioned link would, without closing anything.

Run as its own process so that forwarding never competes with the drill's producer for
one interpreter: ``python -m pipeline.tools.drill.proxy --target HOST:PORT`` prints
``listening PORT`` and then takes commands on stdin, one per line, answering each on
stdout: ``drop`` (answers ``dropped N``), ``stall SECONDS`` (``stalled N``, at once; the
stall ends by itself), ``stats`` (a JSON line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from typing import IO

from pipeline.tools.harness.fleet import Child, Fleet

CHUNK = 65536
CLOSE_SECONDS = 10.0


@dataclass
class ProxyStats:
    connections: int = 0  # accepted since start
    open: int = 0  # open now
    dropped: int = 0  # aborted by drop()
    refused: int = 0  # the target could not be reached
    stalls: int = 0


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to the target; runs on the caller's event loop."""

    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = port
        self.stats = ProxyStats()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._resume: asyncio.TimerHandle | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop()
        if self._server is not None:
            await self._server.wait_closed()

    def drop(self) -> int:
        """Abort every open connection, both sides; returns how many."""
        pairs = list(self._pairs)
        for client, upstream in pairs:
            client.transport.abort()
            upstream.transport.abort()
        self.stats.dropped += len(pairs)
        return len(pairs)

    def stall(self, seconds: float) -> int:
        """Stop forwarding for ``seconds`` (a later stall extends it); returns open connections."""
        loop = asyncio.get_running_loop()
        self._flowing.clear()
        self.stats.stalls += 1
        if self._resume is not None:
            self._resume.cancel()
        self._resume = loop.call_later(seconds, self._flowing.set)
        return len(self._pairs)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        await self._flowing.wait()  # a stalled link leaves new connections unanswered
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            self.stats.refused += 1
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        self.stats.open = len(self._pairs)
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            self._pairs.discard(pair)
            self.stats.open = len(self._pairs)
            for side in pair:
                side.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    return
                if not self._flowing.is_set():
                    await self._flowing.wait()
                writer.write(data)
                await writer.drain()


class ProxyProcess:
    """A proxy running as a child process, driven through its stdin (see the module doc)."""

    def __init__(self, fleet: Fleet, child: Child, port: int) -> None:
        self.fleet = fleet
        self.child = child
        self.port = port
        self._lock = threading.Lock()

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.child.process

    @classmethod
    def start(cls, fleet: Fleet, host: str, port: int, log: IO[bytes]) -> ProxyProcess:
        """Start a proxy to ``host:port`` as a child of ``fleet``; errors go to ``log``."""
        argv = [sys.executable, "-m", "pipeline.tools.drill.proxy", "--target", f"{host}:{port}"]
        child = fleet.start(
            f"proxy to {host}:{port}",
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        assert child.process.stdout is not None
        line = child.process.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "listening":
            child.kill()
            fleet.forget(child)
            raise RuntimeError(f"the proxy to {host}:{port} did not start")
        return cls(fleet, child, int(line[1]))

    def command(self, text: str) -> str:
        """Send one command line and return the proxy's one-line answer."""
        assert self.process.stdin is not None and self.process.stdout is not None
        with self._lock:
            self.process.stdin.write(text.encode() + b"\n")
            self.process.stdin.flush()
            return self.process.stdout.readline().decode().strip()

    def stats(self) -> ProxyStats:
        """The proxy's counters now (connections accepted, open, dropped...)."""
        return ProxyStats(**json.loads(self.command("stats")))

    def close(self) -> None:
        """Close its stdin (it then exits), wait a little, then kill it."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=CLOSE_SECONDS)
        if self.child.running():
            self.child.kill()
        self.fleet.forget(self.child)
        with contextlib.suppress(OSError):
            if self.process.stdout is not None:
                self.process.stdout.close()


def _target(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError("expected HOST:PORT")
    return host, int(port)


async def _serve(target: tuple[str, int], port: int) -> None:
    proxy = FaultProxy(target[0], target[1], port)
    print(f"listening {await proxy.start()}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        command, _, argument = line.partition(" ")
        if command == "drop":
            answer = f"dropped {proxy.drop()}"
        elif command == "stall":
            answer = f"stalled {proxy.stall(float(argument))}"
        elif command == "stats":
            answer = json.dumps(asdict(proxy.stats))
        else:
            answer = f"error unknown command {command!r}"
        print(answer, flush=True)
    await proxy.close()  # stdin closed: the drill is done (or gone)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tools.drill.proxy")
    parser.add_argument("--target", type=_target, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--port", type=int, default=0, help="local port (default: any free)")
    options = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(options.target, options.port))


if __name__ == "__main__":
    main()
