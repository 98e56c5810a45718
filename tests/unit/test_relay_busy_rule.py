"""When the relay polls instead of waiting for NOTIFY (pure rule, no servers)."""

from __future__ import annotations

from pipeline.relay.relay import BusyRule

INTERVAL = 0.005
QUICK, SLOW = 0.001, 0.008


def test_sixteen_quick_productive_cycles_in_a_row_make_the_relay_busy():
    rule = BusyRule(INTERVAL)
    decisions = [rule.busy_after(QUICK, 1, False, False) for _ in range(BusyRule.QUICK_CYCLES)]
    assert decisions == [False] * (BusyRule.QUICK_CYCLES - 1) + [True]


def test_a_slow_wait_or_an_empty_cycle_starts_the_count_again():
    rule = BusyRule(INTERVAL)
    for interruption in ((SLOW, 1), (QUICK, 0)):
        for _ in range(BusyRule.QUICK_CYCLES - 1):
            assert not rule.busy_after(QUICK, 1, False, False)
        assert not rule.busy_after(*interruption, False, False)
    assert not rule.busy_after(QUICK, 1, False, False)  # one quick cycle since the last reset


def test_a_steady_stream_slower_than_the_interval_never_makes_it_busy():
    rule = BusyRule(INTERVAL)  # e.g. 100 transactions/s: a NOTIFY every ~8 ms of waiting
    assert not any(rule.busy_after(SLOW, 10, False, False) for _ in range(1000))


def test_a_full_claim_makes_it_busy_at_once_and_a_busy_relay_stays_busy_while_it_finds_work():
    rule = BusyRule(INTERVAL)
    assert rule.busy_after(SLOW, 500, True, False)
    assert rule.busy_after(INTERVAL, 3, False, True)  # a busy poll waits the whole interval
    assert not rule.busy_after(INTERVAL, 0, False, True)  # nothing found: the hand-off follows
