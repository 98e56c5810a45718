"""Events sent to nobody: real relay and worker processes refuse them or send them on.

A relay (or publishing worker) started without the modules that register the consumers
of the events waiting in the outbox refuses to start with one clear line, unless told
that is meant (``--allow-unrouted``); events it then sends to nobody are found by
``pipeline status`` (a problem) and ``pipeline dlq unrouted``, and ``pipeline dlq
resend-unrouted`` sends them again, audited, once their consumers run (there, in this
process: the resend is the subject, not the processes).
"""

from __future__ import annotations

import json
from collections import Counter

from pipeline import NewEvent, Settings
from tests.integration.test_inbox import inbox_settings, scalar, stage_counts
from tests.support import (
    cli_argv,
    pipeline_env,
    produce,
    run_cli,
    running_pipeline,
    start_process,
    stop_process,
    wait_until,
)

__all__ = ["inbox_settings"]  # the fixture, re-used from the inbox tests

APP = "tests.apps.inbox_app"


def unrouted_count(engine) -> int:
    return scalar(
        engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent' AND consumers = '{}'"
    )


def test_unrouted_events_are_refused_recorded_reported_and_sent_again(
    engine, inbox_settings: Settings, tmp_path
):
    settings = inbox_settings.replace(canary_interval=0)
    orders = [f"unrouted-{i}" for i in range(3)]
    produce(engine, [NewEvent("entry.booked", {"order_id": o}, aggregate_id=o) for o in orders])
    bare = pipeline_env(settings, "")  # no application modules: no consumer of entry.booked

    # 1. Refused: one line naming the event type, non-zero exit, nothing sent.
    log = tmp_path / "refused.log"
    refused = start_process(cli_argv("relay", "--metrics-port", "0"), bare, log)
    assert refused.wait(timeout=60) != 0
    lines = [line for line in log.read_text().splitlines() if "error" in line]
    assert len(lines) == 1, log.read_text()  # one clear line (other lines: start-up warnings)
    assert "entry.booked (3)" in lines[0] and "--allow-unrouted" in lines[0]
    assert "Traceback" not in log.read_text()
    worker_log = tmp_path / "refused-worker.log"
    worker = start_process(
        cli_argv("worker", "--metrics-port", "0"),
        bare,
        worker_log,
    )
    assert worker.wait(timeout=60) != 0
    assert "entry.booked (3)" in worker_log.read_text()
    assert unrouted_count(engine) == 0
    assert scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'pending'") == 3

    # 2. Told it is meant: it starts and sends them to nobody.
    log = tmp_path / "allowed.log"
    allowed = start_process(
        cli_argv("relay", "--metrics-port", "0", "--allow-unrouted"),
        bare,
        log,
    )
    try:
        wait_until(lambda: unrouted_count(engine) == 3, timeout=60, alive=[allowed])
    finally:
        stop_process(allowed)
    assert allowed.returncode == 0, log.read_text()[-2000:]
    text = log.read_text()
    assert "will be sent to nobody: entry.booked (3)" in text  # the start-up warning
    assert text.count("events sent to no consumer") == 1  # once per type, not per event

    # 3. Found: status reports them as a problem; dlq unrouted lists them.
    env = pipeline_env(settings, APP)
    status = run_cli(["status"], env)
    assert status.returncode == 1
    assert "3 events were sent to no consumer: entry.booked (3)" in status.stdout
    listed = run_cli(["dlq", "unrouted", "--json"], env)
    assert listed.returncode == 0, listed.stderr
    assert sorted(e["aggregate_id"] for e in json.loads(listed.stdout)) == orders

    # 4. Sent again once the consumers exist: a dry run first, then audited.
    dry = run_cli(["dlq", "resend-unrouted", "--dry-run"], env)
    assert dry.returncode == 0, dry.stderr
    assert "would send again: 3 entry.booked" in dry.stdout
    assert unrouted_count(engine) == 3  # a dry run changes nothing
    assert run_cli(["dlq", "resend-unrouted"], env).returncode != 0  # a reason is required
    done = run_cli(["dlq", "resend-unrouted", "--reason", "ledger deployed", "--json"], env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert len(report["resent"]) == 3
    audit = scalar(
        engine,
        "SELECT json_build_object('action', action, 'affected', affected, 'reason',"
        " parameters ->> 'reason') FROM pipeline.audit_log ORDER BY id DESC LIMIT 1",
    )
    assert audit == {"action": "dlq.resend_unrouted", "affected": 3, "reason": "ledger deployed"}
    assert unrouted_count(engine) == 0

    # Their consumers now run (a relay and a worker in this process: what is tested is
    # that the events resent reach them, once each, not the processes).
    with running_pipeline(settings, APP, threads=2):
        wait_until(lambda: len(stage_counts(engine, "ledger")) == 3, timeout=60)
    assert stage_counts(engine, "ledger") == Counter({o: 1 for o in orders})
    status = run_cli(["status"], env)
    assert "sent to no consumer: none" in status.stdout
    assert "were sent to no consumer" not in status.stdout
