"""An example Alertmanager webhook receiver: one log line per alert of each notification.

docker-compose's ``alert-receiver`` runs it so that the stack's Alertmanager delivers
somewhere real (``docker compose logs -f alert-receiver``)::

    python -m pipeline.tools.harness.alert_receiver --host 0.0.0.0 --port 8080

Each POST (Alertmanager's webhook payload, version 4) prints, per alert, the receiver
(the request path), its status, name, severity, the other labels and the summary;
``GET /health`` answers ``ok``. Replace it with your pager in a real deployment.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

MAX_BODY = 1 << 20


def alert_lines(receiver: str, payload: dict[str, Any]) -> list[str]:
    """One line per alert of a webhook notification."""
    lines = []
    for alert in payload.get("alerts", []):
        labels = dict(alert.get("labels", {}))
        name = labels.pop("alertname", "?")
        severity = labels.pop("severity", "?")
        rest = " ".join(f"{key}={value}" for key, value in sorted(labels.items()))
        summary = alert.get("annotations", {}).get("summary", "")
        status = alert.get("status", payload.get("status", "?"))
        lines.append(
            f"{receiver}: {status} {name} severity={severity}"
            + (f" {rest}" if rest else "")
            + (f": {summary}" if summary else "")
        )
    return lines


class AlertReceiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, host: str = "127.0.0.1", out: TextIO = sys.stdout) -> None:
        self.out = out
        self.lock = threading.Lock()
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: AlertReceiver

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, b"ok\n")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._answer(400, b"a JSON body of at most 1 MiB\n")
            return
        try:
            payload = json.loads(self.rfile.read(length))
        except ValueError:
            self._answer(400, b"not JSON\n")
            return
        receiver = self.path.strip("/") or "webhook"
        with self.server.lock:
            for line in alert_lines(receiver, payload if isinstance(payload, dict) else {}):
                print(line, file=self.server.out, flush=True)
        self._answer(200, b"ok\n")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Alerts are logged above; request lines would only repeat them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tools.harness.alert_receiver",
        description="Log the alerts of Alertmanager webhook notifications, one line each.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Serve in the foreground until SIGTERM or Ctrl-C."""
    options = build_parser().parse_args(argv)
    server = AlertReceiver(options.port, options.host)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"alert receiver listening on {options.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
