"""Relays and workers as real processes: crashes, concurrency, order (DESIGN I2, I4)."""

from __future__ import annotations

import signal
import threading
from collections import Counter

import pytest
from sqlalchemy import text

from pipeline import NewEvent, Settings, configure
from pipeline.tools.harness.commands import WORKER_READY_LINE
from tests.support import (
    produce,
    queue_envelopes,
    soak,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)

APP = "tests.apps.relay_app"


@pytest.fixture
def proc_settings(settings: Settings) -> Settings:
    value = settings.replace(lease_seconds=2.0, batch_size=200, poll_interval_max=0.5)
    configure(value)
    return value


def status_counts(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(text("SELECT status, count(*) FROM pipeline.outbox GROUP BY 1")).all()
        )


def assert_key_order(envelopes: list[dict]) -> None:
    last: dict[str, int] = {}
    for env in envelopes:
        key, seq = env.get("pipelineorderingkey"), env["pipelineseq"]
        if key is None:
            continue
        assert seq > last.get(key, -1), f"key {key}: seq {seq} delivered after {last[key]}"
        last[key] = seq


@pytest.mark.soak
def test_sigkill_of_a_publishing_worker_loses_nothing(engine, proc_settings, tmp_path):
    settings = proc_settings.replace(batch_size=1000)
    total = soak(10_000, 30_000)
    ids = produce(
        engine,
        [NewEvent("order.placed", {"i": i}, aggregate_id=str(i % 50)) for i in range(total)],
        per_transaction=1000,
    )
    relay = start_relay(settings, APP, tmp_path / "relay.log", "--mode", "workers")
    worker = start_worker(settings, APP, tmp_path / "worker0.log", processes=1, threads=2)
    stranded: dict[str, int] = {}
    try:
        for attempt in range(1, 6):  # kill until a kill lands in the middle of a batch
            wait_until(
                lambda: status_counts(engine).get("publishing", 0) > 0, timeout=60, interval=0.001
            )
            stop_process(worker, signal.SIGKILL)
            stranded = status_counts(engine)
            worker = start_worker(
                settings, APP, tmp_path / f"worker{attempt}.log", processes=1, threads=2
            )
            if stranded.get("publishing", 0) > 0:
                break
        assert stranded.get("publishing", 0) > 0, "no kill landed mid-batch"
        wait_until(
            lambda: status_counts(engine) == {"sent": total},
            timeout=60,
            progress=lambda: status_counts(engine).get("sent"),
            alive=[relay, worker],
        )
    finally:
        stop_process(worker)
        stop_process(relay)
    for queue in ("pipeline.audit", "pipeline.billing"):
        delivered = queue_envelopes(settings, queue)
        assert {e["id"] for e in delivered} == {str(i) for i in ids}, queue
    audit = queue_envelopes(settings, "pipeline.audit")
    duplicates = len(audit) - len({e["id"] for e in audit})
    print(f"stranded at kill: {stranded}; duplicates after the crash: {duplicates}")


@pytest.mark.soak
def test_two_relays_and_two_workers_deliver_everything_once_in_key_order(
    engine, proc_settings, tmp_path
):
    per_producer = soak(2000, 5000)
    relays = [
        start_relay(proc_settings, APP, tmp_path / f"relay{n}.log", "--mode", "auto")
        for n in range(2)
    ]
    worker = start_worker(proc_settings, APP, tmp_path / "worker.log", processes=2, threads=2)
    ids: list = []

    def producer(offset: int) -> None:
        ids.extend(
            produce(
                engine,
                [
                    NewEvent("order.placed", {"i": i}, aggregate_id=str(i % 100))
                    for i in range(offset, offset + per_producer)
                ],
                per_transaction=10,
            )
        )

    try:
        threads = [threading.Thread(target=producer, args=(n * per_producer,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        wait_until(
            lambda: status_counts(engine) == {"sent": 2 * per_producer},
            timeout=60,
            progress=lambda: status_counts(engine).get("sent"),
            alive=[worker, *relays],
        )
        wait_until(  # the exit codes below are about a graceful stop of a running worker
            lambda: (tmp_path / "worker.log").read_text().count(WORKER_READY_LINE) >= 2,
            timeout=60,
            alive=[worker],
        )
    finally:
        for process in [worker, *relays]:
            stop_process(process)
    codes = [p.returncode for p in [worker, *relays]]
    assert codes == [0, 0, 0], (codes, (tmp_path / "worker.log").read_text()[-3000:])
    for queue in ("pipeline.audit", "pipeline.billing"):
        delivered = queue_envelopes(proc_settings, queue)
        counts = Counter(e["id"] for e in delivered)
        assert set(counts) == {str(i) for i in ids}, queue
        assert max(counts.values()) == 1, f"{queue}: an event was delivered twice"
        assert_key_order(delivered)
