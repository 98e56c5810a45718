"""``pipeline demo``: the options, then :func:`pipeline.tools.demo.runner.run_demo`, which
loads on first use (registering the command keeps ``pipeline --help`` fast)."""

from __future__ import annotations

import click

from pipeline.tools.cli.options import (
    events_option,
    http_url,
    json_option,
    processes_option,
    rate_option,
    seconds_option,
    seed_option,
    share_option,
    threads_option,
)


@click.command()
@events_option(
    200,
    "Orders to place (each makes order.placed -> payment.charged -> stock.reserved), "
    "plus one poison order.",
)
@rate_option(
    25.0,
    "Orders per second the producer places (0: as fast as it can). Latency is measured "
    "at this rate; above what the machine sustains it turns into queueing time.",
    zero_allowed=True,
)
@json_option("Print only a JSON summary on stdout.")
@click.option(
    "--keep-running",
    is_flag=True,
    help="After the summary, leave the relay, workers, servers and metrics endpoints up "
    "until Ctrl-C, and write a prometheus.yml (with the pipeline's alert rules) that a local "
    "Prometheus can start on.",
)
@share_option(
    "--duplicates",
    "duplicate_rate",
    0.1,
    "Share of sent events delivered a second time to their consumers.",
)
@share_option(
    "--failures",
    "fail_rate",
    0.05,
    "Share of handler attempts that fail transiently (after doing their work).",
)
@click.option(
    "--poison/--no-poison",
    default=True,
    show_default=True,
    help="Add one order that payments can never process (it must be dead-lettered).",
)
@processes_option(2, "Worker processes.")
@threads_option(4, "Threads per worker process.")
@seconds_option(
    "--timeout",
    90.0,
    "Seconds to wait for every order to finish before reporting a failure.",
    minimum=1,
)
@click.option(
    "--external",
    is_flag=True,
    help="Do not start a relay, workers or API: use running ones (docker-compose). Needs "
    "PIPELINE_DATABASE_URL, PIPELINE_REDIS_URL and --api-url.",
)
@click.option(
    "--api-url",
    default=None,
    callback=http_url,
    help="Use this payment/e-mail API instead of starting one.",
)
@click.option(
    "--worker-metrics-url",
    default=None,
    callback=http_url,
    help="With --external: the workers' /metrics URL, to count the duplicates they absorbed.",
)
@click.option(
    "--keep-data",
    is_flag=True,
    help="Against configured servers: keep the demo's own schemas and Redis keys.",
)
@seed_option("Seed for orders and injected faults.")
def demo(**options: object) -> None:
    """Run an order workflow through a real pipeline and check its guarantees.

    Without PIPELINE_DATABASE_URL / PIPELINE_REDIS_URL it starts throwaway Postgres and
    Redis (the `embedded` extra); it always starts its own relay, workers and local
    payment/e-mail API (unless --external). It injects duplicate deliveries, transient
    failures and a poison event, then prints a summary: events produced, published and
    processed, duplicates absorbed, charges vs orders, dead letters, latency and the
    trace of one order. Exits 1 when an invariant fails, 130 on Ctrl-C; everything it
    started is stopped and deleted either way.
    """
    from pipeline.tools.demo.runner import DemoOptions, run_demo

    code = run_demo(DemoOptions(**options))  # type: ignore[arg-type]
    if code:
        raise click.exceptions.Exit(code)
