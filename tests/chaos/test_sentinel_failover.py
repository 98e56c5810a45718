"""A Redis watched by Sentinel fails over under a running relay and workers: no loss, no
effect twice, the flow back once the sentinels name the new master."""

from __future__ import annotations

import time

import pytest

from pipeline.tools.harness.sentinel import SentinelSet
from tests.chaos.orders import APP, assert_each_stage_once, place_orders, scalar, wait_all_notified
from tests.support import SOAK, start_relay, start_worker, stop_process, wait_until

pytestmark = pytest.mark.chaos


@pytest.mark.skipif(not SOAK, reason="a Sentinel set and two failovers; PIPELINE_SOAK=1 runs it")
def test_failovers_while_relay_and_workers_run_lose_nothing_and_do_nothing_twice(
    engine, chaos_settings, tmp_path
):
    """The master dies (and later an operator forces a failover) while relay and workers
    run on a Redis watched by Sentinel: connections follow the sentinels to the new
    master, commands that met the old one are retried, never acknowledged away; no order
    is lost or handled twice (what a promoted replica missed, the ledger sends again)."""
    orders = [f"failover-{i}" for i in range(90)]
    with SentinelSet() as sentinels:
        settings = chaos_settings.replace(redis_url=sentinels.url)
        relay = start_relay(settings, APP, tmp_path / "relay.log")
        workers = start_worker(settings, APP, tmp_path / "worker.log", 1, 4)

        def effects() -> int:
            return int(scalar(engine, "SELECT count(*) FROM effects"))

        def flowing(since: int) -> None:
            wait_until(
                lambda: effects() > since,
                timeout=60,
                interval=0.2,
                progress=effects,
                alive=[relay, workers],
            )

        try:
            place_orders(engine, orders[:30])
            flowing(0)
            old, failed_over = sentinels.kill_master()
            place_orders(engine, orders[30:60])  # while the workers find the new master
            flowing(effects())
            sentinels.rejoin(old)  # the old master comes back as a replica
            forced = sentinels.force_failover()
            place_orders(engine, orders[60:])
            wait_all_notified(engine, orders, [relay, workers], timeout=90, progress=effects)
            time.sleep(1.0)  # a late duplicate would show now
        finally:
            stop_process(workers)
            stop_process(relay)
    assert failed_over > 0 and forced > 0
    assert_each_stage_once(engine, orders)
    worker_log = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in (tmp_path / "relay.log").read_text()
    assert "failover-" not in worker_log  # payloads never logged, even in failures
