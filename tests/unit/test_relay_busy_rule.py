"""When the relay polls instead of waiting for NOTIFY (pure rule, no servers)."""

from __future__ import annotations

from pipeline.relay.relay import BusyRule

RATE = 500.0  # events/s from which the relay polls


def feed(rule: BusyRule, start: float, seconds: float, per_second: float, busy: bool) -> bool:
    """Cycles every 5 ms finding events at ``per_second``; the rule's last decision."""
    decision = busy
    steps = round(seconds / 0.005)
    for step in range(1, steps + 1):
        found = round(per_second * 0.005 * step) - round(per_second * 0.005 * (step - 1))
        decision = rule.busy_after(start + step * 0.005, found, False, decision)
    return decision


def test_a_stream_at_the_rate_makes_the_relay_busy_within_one_window():
    rule = BusyRule(RATE, now=0.0)
    assert feed(rule, 0.0, BusyRule.WINDOW + 0.01, 600, busy=False)
    assert rule.rate >= RATE


def test_200_events_a_second_in_clusters_stay_on_notify():
    rule = BusyRule(RATE, now=0.0)
    now, decisions = 0.0, []
    for _ in range(400):  # eight producers' commits arriving together every 40 ms
        now += 0.001
        decisions.append(rule.busy_after(now, 8, False, False))
        now += 0.039
        decisions.append(rule.busy_after(now, 0, False, False))
    assert not any(decisions)
    assert 0 < rule.rate < RATE


def test_a_busy_relay_stays_busy_above_half_the_rate_and_leaves_below_it():
    rule = BusyRule(RATE, now=0.0)
    assert feed(rule, 0.0, 1.0, 1000, busy=False)
    assert feed(rule, 1.0, 1.0, 300, busy=True)  # under the rate, above half: no flapping
    assert not feed(rule, 2.0, 1.0, 100, busy=True)


def test_a_busy_relay_whose_producers_stop_leaves_after_its_calm_windows():
    rule = BusyRule(RATE, now=0.0)
    assert feed(rule, 0.0, 1.0, 1000, busy=True)
    assert feed(rule, 1.0, (BusyRule.CALM_WINDOWS - 1) * BusyRule.WINDOW, 0, busy=True)
    assert not feed(rule, 1.2, 2 * BusyRule.WINDOW + 0.01, 0, busy=True)


def test_a_full_claim_makes_it_busy_at_once():
    rule = BusyRule(RATE, now=0.0)
    assert rule.busy_after(0.001, 500, True, False)
