"""The example Alertmanager webhook receiver of docker-compose, over real HTTP."""

from __future__ import annotations

import io
import json
import threading
import urllib.error
import urllib.request

import pytest

from pipeline.tools.harness.alert_receiver import AlertReceiver

pytestmark = pytest.mark.unit

NOTIFICATION = {
    "version": "4",
    "status": "firing",
    "receiver": "on-call",
    "alerts": [
        {
            "status": "firing",
            "labels": {"alertname": "PipelineRelayDown", "severity": "critical", "job": "r"},
            "annotations": {"summary": "No pipeline relay is up: nothing publishes the outbox."},
        },
        {
            "status": "resolved",
            "labels": {"alertname": "PipelineWatchdog", "severity": "info"},
            "annotations": {},
        },
    ],
}


def post(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_each_alert_of_a_notification_is_one_line():
    out = io.StringIO()
    server = AlertReceiver(0, out=out)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert post(f"{url}/on-call", json.dumps(NOTIFICATION).encode()) == 200
        assert post(f"{url}/on-call", b"not json") == 400
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert response.status == 200
    finally:
        server.shutdown()
        server.server_close()
    assert out.getvalue().splitlines() == [
        "on-call: firing PipelineRelayDown severity=critical job=r: No pipeline relay is up: "
        "nothing publishes the outbox.",
        "on-call: resolved PipelineWatchdog severity=info",
    ]
