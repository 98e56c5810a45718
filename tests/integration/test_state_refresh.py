"""The relay's state metrics are read on a thread of their own: a scrape never waits on
Postgres. Through a TCP proxy that stops forwarding (a stalled database), a real relay's
/metrics still answers, reports Postgres down once its values are too old to trust, and
``pipeline_state_metrics_last_success_timestamp_seconds`` stops advancing; it advances
again when the stall ends.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit, urlunsplit

from pipeline import Settings
from pipeline.tools.drill.proxy import ProxyProcess
from pipeline.tools.harness.fleet import Fleet
from tests.integration.test_observability import free_port, scrape, scrape_when_up, series
from tests.support import cli_argv, pipeline_env, start_process, stop_process, wait_until

APP = "tests.apps.relay_app"
STALL_SECONDS = 120  # a cap: the test ends the stall once it has seen what it needs


def through(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    hostport = f"127.0.0.1:{port}"
    return urlunsplit(
        parts._replace(netloc=f"{netloc[0]}@{hostport}" if len(netloc) == 2 else hostport)
    )


def test_a_scrape_never_waits_on_a_stalled_postgres(settings: Settings, tmp_path):
    target = urlsplit(settings.require_database_url())
    fleet = Fleet()
    relay = None
    log = tmp_path / "relay.log"
    try:
        with (tmp_path / "proxy.log").open("ab") as proxy_log:
            proxy = ProxyProcess.start(
                fleet, target.hostname or "127.0.0.1", target.port or 5432, proxy_log
            )
        stalled = settings.replace(
            database_url=through(settings.require_database_url(), proxy.port),
            state_metrics_interval=0.5,
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}/metrics"
        env = pipeline_env(stalled, APP, PIPELINE_STATE_METRICS_INTERVAL="0.5")
        relay = start_process(
            cli_argv("relay", "--metrics-port", str(port)),
            env,
            log,
        )
        scrape_when_up(url, relay, log)

        def last_success() -> float:
            value = series(scrape(url), "pipeline_state_metrics_last_success_timestamp_seconds")
            assert value is not None
            return value

        def postgres_up() -> float | None:
            return series(scrape(url), "pipeline_state_up", source="postgres", transport="redis")

        first = wait_until(last_success, timeout=30)
        wait_until(lambda: last_success() > first, timeout=30)  # it advances while healthy
        assert postgres_up() == 1.0

        assert proxy.command(f"stall {STALL_SECONDS}").startswith("stalled")
        # Every scrape answers within the HTTP client's timeout (5 s) while Postgres is
        # stalled; after a while the stale values are dropped and Postgres reported down.
        wait_until(lambda: postgres_up() == 0.0, timeout=STALL_SECONDS)
        stuck = last_success()
        text = scrape(url)
        assert series(text, "pipeline_outbox_backlog", status="pending") is None
        for _ in range(10):  # more refresh intervals pass: the timestamp does not move
            assert last_success() == stuck
            time.sleep(0.5)
        assert relay.poll() is None

        # The stall ends: the refresher, stuck in its query, reads Postgres again.
        assert proxy.command("stall 0").startswith("stalled")
        wait_until(lambda: last_success() > stuck, timeout=60)
        wait_until(lambda: postgres_up() == 1.0, timeout=30)
        proxy.close()
    finally:
        if relay is not None:
            stop_process(relay)
        fleet.close()
