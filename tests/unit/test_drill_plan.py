"""The drill's pure parts: fault schedule, order plan, held losses and their probable cause."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pipeline.tools.drill.check import Undelivered, mark_held
from pipeline.tools.drill.faults import (
    AMQP_KINDS,
    HOSTS_AMQP_KINDS,
    HOSTS_ONLY,
    KINDS,
    ONE_HOST_KINDS,
    OWNED_ONLY,
    REDIS_ALONE,
    SENTINEL_ONLY,
    STAGING_KINDS,
    Fault,
    schedule,
)
from pipeline.tools.drill.report import probable_cause
from pipeline.tools.drill.runner import DrillError, DrillOptions, allowed_kinds
from pipeline.tools.drill.workflow import LEDGER, PAYMENTS
from pipeline.tools.drill.workload import plan_orders


def test_every_kind_at_least_once_when_there_are_enough_faults():
    faults = schedule(KINDS, 40, 100.0, random.Random(3))
    counts = Counter(f.kind for f in faults)
    assert len(faults) == 40
    assert set(counts) == set(KINDS)
    assert all(5.0 <= f.offset <= 90.0 for f in faults)
    assert [f.offset for f in faults] == sorted(f.offset for f in faults)


def test_a_relay_pause_outlasts_the_lease_by_one_to_three_seconds():
    pauses = [f for f in schedule(KINDS, 60, 100.0, random.Random(5)) if f.kind == "relay-pause"]
    assert pauses and all(1.0 <= f.seconds <= 3.0 for f in pauses)
    assert "relay-pause" in STAGING_KINDS  # done to the drill's own processes only


def test_fewer_faults_than_kinds_take_distinct_kinds():
    faults = schedule(KINDS, 4, 10.0, random.Random(1))
    assert len({f.kind for f in faults}) == 4


def test_the_same_seed_gives_the_same_schedule():
    def plan(seed: int) -> list[tuple[str, float, str, float]]:
        return [
            (f.kind, f.offset, f.target, f.seconds)
            for f in schedule(KINDS, 20, 60.0, random.Random(seed))
        ]

    assert plan(9) == plan(9)
    assert plan(9) != plan(10)


def test_given_servers_are_never_restarted():
    staging = DrillOptions(database_url="postgresql://h/db", redis_url="redis://h:6379/0")
    assert allowed_kinds(staging) == STAGING_KINDS
    assert not set(allowed_kinds(staging)) & OWNED_ONLY
    own_redis = DrillOptions(database_url="postgresql://h/db")
    assert {k for k in allowed_kinds(own_redis) if k.startswith("redis-")} == {
        k for k in KINDS if k.startswith("redis-")
    }
    assert not any(k.startswith("postgres-") for k in allowed_kinds(own_redis))
    with pytest.raises(DrillError, match="'redis-down' restarts a server"):
        allowed_kinds(DrillOptions(redis_url="redis://h:6379/0", fault_kinds=("redis-down",)))
    with pytest.raises(DrillError, match="unknown fault kind 'reboot'"):
        allowed_kinds(DrillOptions(fault_kinds=("reboot",)))


def test_on_rabbitmq_the_redis_kinds_give_way_to_the_rabbitmq_ones():
    amqp = allowed_kinds(DrillOptions(transport="amqp"))
    assert amqp == AMQP_KINDS
    assert not any(k.startswith(("redis-", "sentinel-")) for k in amqp)
    assert {k for k in amqp if k.startswith("rabbit-")} == {
        "rabbit-kill-node", "rabbit-restart-node", "rabbit-no-majority", "rabbit-stall"
    }  # fmt: skip
    assert set(ONE_HOST_KINDS) - set(amqp) == {k for k in KINDS if k.startswith("redis-")}
    single = allowed_kinds(DrillOptions(transport="amqp", rabbit_nodes=1))
    assert set(amqp) - set(single) == {"rabbit-no-majority"}
    assert not any(k.startswith("rabbit-") for k in allowed_kinds(DrillOptions()))
    for options, refusal in (
        (
            DrillOptions(transport="amqp", fault_kinds=("sentinel-failover",)),
            "fault kind 'sentinel-failover' acts on Redis, which --transport amqp replaces "
            "(use the rabbit-* kinds)",
        ),
        (
            DrillOptions(fault_kinds=("rabbit-kill-node",)),
            "fault kind 'rabbit-kill-node' acts on the drill's RabbitMQ cluster: run with "
            "--transport amqp",
        ),
        (
            DrillOptions(transport="amqp", rabbit_nodes=1, fault_kinds=("rabbit-no-majority",)),
            "fault kind 'rabbit-no-majority' needs three RabbitMQ nodes (--rabbit-nodes 3)",
        ),
        (
            DrillOptions(transport="amqp", sentinel=True),
            "--transport amqp runs the drill's own RabbitMQ cluster instead of Redis: "
            "drop --sentinel/--redis-url",
        ),
    ):
        with pytest.raises(DrillError) as refused:
            allowed_kinds(options)
        assert str(refused.value) == refusal


def test_across_hosts_on_rabbitmq_the_network_and_node_kinds_apply_but_no_stall():
    both = allowed_kinds(DrillOptions(transport="amqp", hosts=True))
    assert both == HOSTS_AMQP_KINDS
    assert set(both) >= HOSTS_ONLY
    assert {k for k in both if k.startswith("rabbit-")} == {
        "rabbit-kill-node", "rabbit-restart-node", "rabbit-no-majority"
    }  # fmt: skip
    assert not any(k.startswith(("redis-", "sentinel-", "proxy-")) for k in both)
    single = allowed_kinds(DrillOptions(transport="amqp", hosts=True, rabbit_nodes=1))
    assert set(both) - set(single) == {"rabbit-no-majority"}
    chosen = ("partition-relay-broker", "rabbit-kill-node")
    assert allowed_kinds(DrillOptions(transport="amqp", hosts=True, fault_kinds=chosen)) == chosen
    with pytest.raises(DrillError) as refused:
        allowed_kinds(DrillOptions(transport="amqp", hosts=True, fault_kinds=("rabbit-stall",)))
    assert str(refused.value) == (
        "fault kind 'rabbit-stall' acts through the proxies, which do not run across hosts"
    )


def test_rabbitmq_faults_last_as_planned_and_proxy_faults_name_the_broker():
    faults = schedule(AMQP_KINDS, 80, 100.0, random.Random(7), broker="rabbitmq")
    by_kind: dict[str, list[Fault]] = {}
    for fault in faults:
        by_kind.setdefault(fault.kind, []).append(fault)
    assert all(2.0 <= f.seconds <= 6.0 for f in by_kind["rabbit-kill-node"])
    assert all(5.0 <= f.seconds <= 15.0 for f in by_kind["rabbit-no-majority"])
    assert all(3.0 <= f.seconds <= 12.0 for f in by_kind["rabbit-stall"])
    targets = {f.target for f in faults if f.kind.startswith("proxy-")}
    assert targets == {"postgres", "rabbitmq", "both"}


def test_hosts_and_sentinel_together_allow_the_network_and_the_sentinel_kinds():
    both = allowed_kinds(DrillOptions(hosts=True, sentinel=True))
    assert set(both) >= HOSTS_ONLY | SENTINEL_ONLY
    assert not set(both) & REDIS_ALONE
    chosen = ("partition-worker-broker", "sentinel-failover")
    assert allowed_kinds(DrillOptions(hosts=True, sentinel=True, fault_kinds=chosen)) == chosen
    with pytest.raises(DrillError, match="--sentinel starts the drill's own Redis"):
        allowed_kinds(DrillOptions(sentinel=True, redis_url="redis://h:6379/0"))


def test_the_plan_numbers_each_accounts_orders_in_sequence_with_poison_among_them():
    plan = plan_orders("r", 1000, 3, random.Random(4))
    assert len(plan) == 1003 and sum(o.poison for o in plan) == 3
    assert len({o.order_id for o in plan}) == 1003
    seen: dict[str, int] = {}
    for order in plan:
        assert order.n == seen.get(order.account, 0) + 1
        seen[order.account] = order.n
    assert len(seen) == 25  # about forty orders per account
    amounts = {type(o.payload()["amount_cents"]) for o in plan if not o.poison}
    assert amounts == {int}
    assert {o.payload()["amount_cents"] for o in plan if o.poison} == {"12,50"}


def lost(consumer: str, seq: int, key: str | None, published: float | None = 10.0) -> Undelivered:
    return Undelivered(
        consumer, f"e{seq}", "order.placed", f"o{seq}", "sent", published, None, key, seq
    )


def test_later_events_of_an_ordered_key_are_held_behind_its_first_undelivered_one():
    marked = mark_held(
        [
            lost(LEDGER, 7, "account:a"),
            lost(LEDGER, 3, "account:a"),
            lost(LEDGER, 5, "account:b"),
            lost(PAYMENTS, 4, "account:a"),  # unordered: never held
            lost(PAYMENTS, 6, "account:a"),
        ]
    )
    held = {(u.consumer, u.seq) for u in marked if u.held}
    assert held == {(LEDGER, 7)}
    assert len(marked) == 5


def test_a_loss_is_laid_at_the_fault_in_progress_at_its_publication_else_the_next():
    faults = [
        Fault("redis-down", 0.0, started=100.0, ended=105.0),
        Fault("worker-kill", 0.0, started=110.0, ended=112.0),
    ]
    assert probable_cause(lost(PAYMENTS, 1, None, 102.0), faults, 0.0) == "redis-down"
    assert probable_cause(lost(PAYMENTS, 1, None, 107.0), faults, 0.0) == "worker-kill"
    assert probable_cause(lost(PAYMENTS, 1, None, 120.0), faults, 0.0) == "after the last fault"
    assert probable_cause(lost(PAYMENTS, 1, None, None), faults, 0.0) == "not published"
    # the database's clock runs 50 s ahead of the drill's
    assert probable_cause(lost(PAYMENTS, 1, None, 152.0), faults, 50.0) == "redis-down"
