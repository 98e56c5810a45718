"""The drill's fault schedule and order plan: seeded, complete, and within their bounds."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pipeline.drill.faults import KINDS, OWNED_ONLY, STAGING_KINDS, schedule
from pipeline.drill.runner import DrillError, DrillOptions, allowed_kinds
from pipeline.drill.workload import plan_orders


def test_every_kind_at_least_once_when_there_are_enough_faults():
    faults = schedule(KINDS, 40, 100.0, random.Random(3))
    counts = Counter(f.kind for f in faults)
    assert len(faults) == 40
    assert set(counts) == set(KINDS)
    assert all(5.0 <= f.offset <= 90.0 for f in faults)
    assert [f.offset for f in faults] == sorted(f.offset for f in faults)


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
