"""The end-to-end canary reveals a stalled pipeline and recovers with it.

The relay and the worker run in this process (the canary's path, not the processes, is
the subject; a relay that dies is the chaos tests' matter), so the worker's
``pipeline_canary_last_success_timestamp_seconds`` is this process's gauge.
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from pipeline.registry import CANARY_CONSUMER, CANARY_EVENT_TYPE
from pipeline.runtime import build_runtime
from tests.support import app_registry, queue_envelopes, running_relay, running_worker, wait_until

APP = "tests.apps.relay_app"  # routes only; the canary consumer is built in
LAST_SUCCESS = "pipeline_canary_last_success_timestamp_seconds"
INTERVAL = 0.3
STALL = 1.5  # five canary intervals without a relay


def last_success() -> float:
    """When a canary last completed the path, as the worker's gauge says (0: never)."""
    return REGISTRY.get_sample_value(LAST_SUCCESS) or 0.0


def canaries(engine: Engine) -> tuple[int, int]:
    """How many canaries were sent, and how many the canary consumer processed."""
    with engine.connect() as conn:
        sent = conn.execute(
            text("SELECT count(*) FROM pipeline.outbox WHERE event_type = :t AND status = 'sent'"),
            {"t": CANARY_EVENT_TYPE},
        ).scalar_one()
        processed = conn.execute(
            text(
                "SELECT count(*) FROM pipeline.inbox WHERE consumer = :c AND status = 'processed'"
            ),
            {"c": CANARY_CONSUMER},
        ).scalar_one()
    return int(sent), int(processed)


def test_stopping_the_relay_makes_the_canary_age_grow_and_restarting_recovers(engine, settings):
    settings = settings.replace(canary_interval=INTERVAL)
    runtime = build_runtime(settings, app_registry(APP), set_global_broker=False)
    started = time.time()  # the gauge is process-wide: an earlier test may have set it
    try:
        with running_worker(runtime, threads=2):
            with running_relay(runtime, runtime.registry):
                wait_until(lambda: last_success() > started and canaries(engine)[1] >= 4, 30)
                healthy_age = time.time() - last_success()
                assert healthy_age < 1.0
            # the canaries the stopped relay sent still arrive; then nothing does
            wait_until(lambda: len(set(canaries(engine))) == 1, timeout=30)
            stalled_at = last_success()
            time.sleep(STALL)  # what is shown: nothing arrives while no relay runs
            assert last_success() == stalled_at
            assert time.time() - stalled_at > STALL  # the age grows while nothing flows
            with running_relay(runtime, runtime.registry):
                wait_until(lambda: last_success() > stalled_at, timeout=30)
                assert time.time() - last_success() < 2.0
    finally:
        runtime.close()
    assert canaries(engine)[1] >= 5
    # the "*" subscriber "audit" never sees the pipeline's own events
    assert queue_envelopes(settings, "pipeline.audit") == []
