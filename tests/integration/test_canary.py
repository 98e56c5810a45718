"""The end-to-end canary reveals a stalled pipeline and recovers with it."""

from __future__ import annotations

import signal
import time

from sqlalchemy import text

from tests.support import (
    multiprocess_metric,
    queue_envelopes,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.relay_app"  # routes only; the canary consumer is built in
LAST_SUCCESS = "pipeline_canary_last_success_timestamp_seconds"


def test_killing_the_relay_makes_the_canary_age_grow_and_restarting_recovers(
    engine, settings, tmp_path
):
    settings = settings.replace(canary_interval=0.3)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    worker = start_worker(
        settings, APP, tmp_path / "worker.log", 1, 2, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)
    )
    relay = start_relay(settings, APP, tmp_path / "relay1.log", "--metrics-port", "0")
    try:
        wait_until(lambda: multiprocess_metric(metrics_dir, LAST_SUCCESS) > 0, timeout=30)
        time.sleep(1.0)
        healthy_age = time.time() - multiprocess_metric(metrics_dir, LAST_SUCCESS)
        assert healthy_age < 1.0
        stop_process(relay, signal.SIGKILL)
        stalled_at = multiprocess_metric(metrics_dir, LAST_SUCCESS)
        time.sleep(2.5)
        assert multiprocess_metric(metrics_dir, LAST_SUCCESS) == stalled_at
        assert time.time() - stalled_at > 2.0  # the age grows while nothing flows
        relay = start_relay(settings, APP, tmp_path / "relay2.log", "--metrics-port", "0")
        wait_until(lambda: multiprocess_metric(metrics_dir, LAST_SUCCESS) > stalled_at, 30)
        assert time.time() - multiprocess_metric(metrics_dir, LAST_SUCCESS) < 2.0
    finally:
        stop_process(relay)
        stop_process(worker)
    with engine.connect() as conn:
        processed = conn.execute(
            text(
                "SELECT count(*) FROM pipeline.inbox WHERE consumer = 'pipeline_canary'"
                " AND status = 'processed'"
            )
        ).scalar()
    assert processed >= 5
    # the "*" subscriber "audit" never sees the pipeline's own events
    assert queue_envelopes(settings, "pipeline.audit") == []
