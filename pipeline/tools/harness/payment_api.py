"""A local payment API that honours ``Idempotency-Key`` the way Stripe documents it.

* same key, same body, finished: the stored response again — no new charge;
* same key, different body: 422;
* same key while the first request is still running: 409;
* no key: 400 (this API insists on idempotent retries).

Every POST path behaves the same way; ``pipeline demo`` and ``pipeline drill`` charge
through ``/v1/charges`` and send e-mails through ``/v1/emails`` of one server.
``GET /ledger`` returns what was done (``?run=ID`` keeps the records whose request
carried that ``run``), ``GET /health`` answers ``{"status": "ok"}``.

Tests and ``pipeline demo`` use it to show that retried handlers charge once; it also
runs on its own for docker-compose::

    python -m pipeline.tools.harness.payment_api --host 0.0.0.0 --port 8080
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

CHARGES_PATH = "/v1/charges"
EMAILS_PATH = "/v1/emails"
ID_PREFIXES = {"charges": "ch", "emails": "em"}


@dataclass
class Ledger:
    """What the API has done, for assertions and the demo summary."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    charges: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    stored: dict[str, tuple[str, int, bytes]] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)

    def keys_seen(self) -> list[str]:
        with self.lock:
            return [r["key"] for r in self.requests]

    def snapshot(self, run: str | None = None) -> dict[str, Any]:
        """The ledger as JSON-ready data; ``run`` keeps only records of that demo run.

        Each request's ``outcome``: ``created`` (a new effect), ``replayed`` (the stored
        response, no new effect), ``conflict`` (409), ``mismatch`` (422), ``rejected`` (400).
        """
        with self.lock:
            charges = [c for c in self.charges if run is None or _run_of(c["request"]) == run]
            requests = [r for r in self.requests if run is None or r.get("run") == run]
            by_path: dict[str, dict[str, int]] = {}
            by_key: dict[str, list[str]] = {}
            for request in requests:
                outcome = str(request.get("outcome", "pending"))
                counts = by_path.setdefault(request["path"], {"requests": 0})
                counts["requests"] += 1
                counts[outcome] = counts.get(outcome, 0) + 1
                if request["key"]:
                    by_key.setdefault(request["key"], []).append(outcome)
            return {
                "charges": charges,
                "requests": len(requests),
                "by_path": by_path,
                "outcomes_by_key": by_key,
            }


def _run_of(request: Any) -> Any:
    return request.get("run") if isinstance(request, dict) else None


class _Handler(BaseHTTPRequestHandler):
    server: PaymentServer
    protocol_version = "HTTP/1.1"  # keep-alive: handlers reuse their connections
    disable_nagle_algorithm = True  # headers and body leave at once, no delayed-ACK stall

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no request logs
        return

    def _reply(self, status: int, body: dict[str, Any] | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok"})
            return
        run = parse_qs(url.query).get("run", [None])[0]
        self._reply(200, self.server.ledger.snapshot(run))

    def do_POST(self) -> None:
        ledger = self.server.ledger
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        key = self.headers.get("Idempotency-Key")
        path = self.path.rstrip("/")
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = {}
        record: dict[str, Any] = {
            "key": key,
            "path": path,
            "traceparent": self.headers.get("traceparent"),
            "run": _run_of(request),
        }
        with ledger.lock:
            ledger.requests.append(record)
        if not key:
            record["outcome"] = "rejected"
            self._reply(400, {"error": "Idempotency-Key header is required"})
            return
        fingerprint = hashlib.sha256(path.encode() + b"\0" + body).hexdigest()
        with ledger.lock:
            if key in ledger.in_flight:
                conflict: int | None = 409
                record["outcome"] = "conflict"
            elif key in ledger.stored:
                stored_fingerprint, status, response = ledger.stored[key]
                if stored_fingerprint != fingerprint:
                    conflict = 422
                    record["outcome"] = "mismatch"
                else:
                    record["outcome"] = "replayed"
                    self._reply(status, response)
                    return
            else:
                conflict = None
                ledger.in_flight.add(key)
                record["outcome"] = "created"
        if conflict is not None:
            message = "request in flight" if conflict == 409 else "key reused with another body"
            self._reply(conflict, {"error": message})
            return
        try:
            if self.server.delay:
                time.sleep(self.server.delay)
            with ledger.lock:
                prefix = ID_PREFIXES.get(path.rsplit("/", 1)[-1], "ch")
                charge = {
                    "id": f"{prefix}_{len(ledger.charges) + 1}",
                    "path": path,
                    "key": key,
                    "request": request,
                }
                ledger.charges.append(charge)
                response = json.dumps(charge).encode()
                ledger.stored[key] = (fingerprint, 200, response)
            self._reply(200, response)
        finally:
            with ledger.lock:
                ledger.in_flight.discard(key)


class PaymentServer(ThreadingHTTPServer):
    """Serve on 127.0.0.1 (an ephemeral port by default) in a background thread."""

    daemon_threads = True

    def __init__(self, port: int = 0, delay: float = 0.0, host: str = "127.0.0.1") -> None:
        super().__init__((host, port), _Handler)
        self.ledger = Ledger()
        self.delay = delay
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = str(self.server_address[0])
        if host in ("0.0.0.0", ""):  # noqa: S104 - reachable locally through the loopback
            host = "127.0.0.1"
        return f"http://{host}:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request (a worker killed at shutdown) is not an error
        worth a traceback on the demo's terminal; anything else is reported as usual."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def start(self) -> PaymentServer:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:  # shutdown() waits for a serve_forever that must be running
            self.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.server_close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tools.harness.payment_api",
        description="A local payment and e-mail API honouring Idempotency-Key like Stripe.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each new effect takes")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Serve in the foreground until SIGTERM or Ctrl-C (docker-compose's ``payment-api``)."""
    options = build_parser().parse_args(argv)
    import signal

    server = PaymentServer(options.port, options.delay, options.host)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"payment API listening on {options.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
