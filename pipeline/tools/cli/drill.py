"""``pipeline drill``: the options, then :func:`pipeline.tools.drill.runner.run_drill`,
which loads on first use (registering the command keeps ``pipeline --help`` fast)."""

from __future__ import annotations

import click

from pipeline.tools.cli.options import (
    count_option,
    events_option,
    json_option,
    processes_option,
    rate_option,
    seconds_option,
    seed_option,
    server_url_options,
    threads_option,
)

FAULT_KINDS_HELP = (
    "Comma-separated fault kinds to inject (default: every kind this run may do): "
    "relay-kill, relay-pause, worker-kill, listen-terminate, worker-terminate, worker-pause, "
    "postgres-restart-fast, postgres-restart-immediate, redis-restart-always, "
    "redis-restart-everysec, redis-restart-volatile, redis-down, proxy-drop, proxy-stall, "
    "clock-skew; with --hosts also partition-worker-broker, partition-worker-postgres, "
    "partition-worker-both, partition-relay-postgres, partition-relay-broker, zombie-relay, "
    "link-degrade (the proxy kinds then do not apply); with --sentinel sentinel-kill-master "
    "and sentinel-failover instead of the redis-* kinds; with --transport amqp "
    "rabbit-kill-node, rabbit-restart-node, rabbit-no-majority (three nodes) and rabbit-stall "
    "(not with --hosts: it works through the proxies) instead of the redis-* kinds."
)


def _kinds(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    return tuple(kind.strip() for kind in (value or "").split(",") if kind.strip())


@click.command()
@events_option(
    2000,
    "Orders to place; each makes three events (order.placed, payment.charged, "
    "order.shipped) and four deliveries.",
)
@count_option(
    "--faults", 13, "Faults to inject; each selected kind at least once when there are enough."
)
@seed_option("Seed of the orders and the fault schedule.")
@rate_option(100.0, "Orders per second.")
@click.option("--fault-kinds", callback=_kinds, default=None, help=FAULT_KINDS_HELP)
@seconds_option(
    "--recovery-timeout",
    120.0,
    "Seconds after the last fault within which every delivery must be done.",
    minimum=1,
)
@server_url_options(
    database="Run against this Postgres (staging) instead of a throwaway one; the drill works in "
    "a schema of its own and never restarts this server.",
    redis="Run against this Redis instead of a throwaway one; the drill uses a key namespace "
    "of its own and never restarts this server.",
)
@count_option(
    "--poison",
    3,
    "Poison orders to place on purpose (each must end as dead letters, nothing else).",
)
@count_option("--relays", 2, minimum=1)
@count_option("--workers", 2, minimum=1)
@processes_option(1, "Dramatiq processes per worker.")
@threads_option(4, "Threads per Dramatiq process.")
@click.option(
    "--keep",
    is_flag=True,
    help="Keep logs, the throwaway servers' data, and (staging) the schemas and Redis keys.",
)
@click.option(
    "--hosts",
    is_flag=True,
    help="Run Postgres, the broker (Redis, or every RabbitMQ node), each relay, each worker "
    "group and the producer on hosts of their own (network namespaces on this machine; needs "
    "root) and cut links between them.",
)
@seconds_option(
    "--network-seconds",
    30.0,
    "Longest partition or degraded link (--hosts); each lasts between 5 s and this.",
    minimum=1,
)
@click.option(
    "--sentinel",
    is_flag=True,
    help="Run the drill's Redis as a master, a replica and three sentinels, reached through "
    "a redis+sentinel:// URL, and fail it over.",
)
@click.option(
    "--transport",
    type=click.Choice(["redis", "amqp"]),
    default="redis",
    show_default=True,
    help="The broker: the drill's own Redis, or (amqp) its own RabbitMQ cluster of "
    "--rabbit-nodes nodes (Debian's rabbitmq-server on this machine, or on the broker host "
    "with --hosts; quorum queues).",
)
@click.option(
    "--rabbit-nodes",
    type=click.Choice(["1", "3"]),
    default="3",
    show_default=True,
    callback=lambda ctx, param, value: int(value),
    help="Nodes of the drill's RabbitMQ cluster (--transport amqp).",
)
@json_option("Print the report as one JSON object.")
def drill(**options: object) -> None:
    """Run orders through a real pipeline while injecting faults, then check its guarantees.

    Starts relays, workers and a payment API of its own, and (unless --database-url /
    --redis-url) throwaway Postgres and Redis servers (--transport amqp: a RabbitMQ
    cluster). While orders flow it kills relays and workers, terminates their database
    connections, restarts the servers it owns, drops and stalls connections through its
    proxies and places orders from a producer with a shifted clock. Then it checks that
    every event was processed by every subscribed consumer exactly once, that the API
    charged each order once, that ordered consumers kept each key's order, that only the
    poison orders were dead-lettered, and that the backlog was back to zero within
    --recovery-timeout. Exits 1 on any violation.
    """
    from pipeline.tools.drill.runner import DrillOptions, run_drill

    code = run_drill(DrillOptions(**options))  # type: ignore[arg-type]
    if code:
        raise click.exceptions.Exit(code)
