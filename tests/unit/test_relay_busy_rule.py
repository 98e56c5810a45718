"""When the relay polls instead of waiting for NOTIFY (pure rule, no servers).

The rule is unit-agnostic; these tests count time in whole milliseconds (a 50 ms window,
0.5 events per ms = 500 events/s), so that window boundaries fall exactly where intended.
"""

from __future__ import annotations

from pipeline.relay.relay import BusyRule

WINDOW_MS = 50
RATE_PER_MS = 0.5  # 500 events/s


def rule_at(now: int = 0) -> BusyRule:
    rule = BusyRule(RATE_PER_MS, now=now)
    rule.WINDOW = WINDOW_MS
    return rule


def window(rule: BusyRule, start: int, events: int, busy: bool) -> bool:
    """One window of 5 ms cycles finding ``events`` in all; the rule's last decision."""
    decision = busy
    for step in range(1, WINDOW_MS // 5 + 1):
        found = events * step // 10 - events * (step - 1) // 10
        decision = rule.busy_after(start + 5 * step, found, False, decision)
    return decision


def test_two_windows_in_a_row_at_the_rate_make_the_relay_busy_and_one_does_not():
    rule = rule_at()
    assert not window(rule, 0, 30, busy=False)  # 600 events/s, one window
    assert window(rule, 50, 30, busy=False)  # and a second one
    rule = rule_at()
    assert not window(rule, 0, 30, busy=False)
    assert not window(rule, 50, 5, busy=False)  # the streak is broken
    assert not window(rule, 100, 30, busy=False)


def test_one_large_transaction_does_not_make_it_busy():
    rule = rule_at()
    decisions = [rule.busy_after(1, 500, False, False)]  # 500 events in one claim
    decisions += [rule.busy_after(t, 0, False, False) for t in range(5, 1000, 5)]
    assert not any(decisions)


def test_200_events_a_second_in_clusters_stay_on_notify():
    rule = rule_at()
    now, decisions = 0, []
    for _ in range(400):  # eight producers' commits arriving together every 40 ms
        now += 1
        decisions.append(rule.busy_after(now, 8, False, False))
        now += 39
        decisions.append(rule.busy_after(now, 0, False, False))
    assert not any(decisions)
    assert 0 < rule.rate < RATE_PER_MS


def test_a_busy_relay_leaves_after_exactly_five_calm_windows_in_a_row():
    rule = rule_at()
    for start in (0, 50):
        window(rule, start, 50, busy=False)
    busy = True
    for index in range(BusyRule.CALM_WINDOWS - 1):
        busy = window(rule, 100 + WINDOW_MS * index, 0, busy)
        assert busy
    assert not window(rule, 100 + WINDOW_MS * (BusyRule.CALM_WINDOWS - 1), 0, busy)


def test_calm_and_middling_windows_alternating_keep_it_busy():
    rule = rule_at()
    for start in (0, 50):
        window(rule, start, 50, busy=False)
    busy, start = True, 100
    for index in range(40):  # 0 and 300 events/s in turn: never five calm windows in a row
        busy = window(rule, start, 0 if index % 2 else 15, busy)
        start += WINDOW_MS
        assert busy


def test_a_backlog_makes_it_busy_at_once_and_resets_the_calm_count():
    rule = rule_at()
    assert rule.busy_after(1, 500, True, False)
    for index in range(BusyRule.CALM_WINDOWS - 1):
        window(rule, 1 + WINDOW_MS * index, 0, busy=True)
    assert rule.busy_after(250, 500, True, True)  # a backlog again
    assert window(rule, 251, 0, busy=True)  # so one calm window does not end it
