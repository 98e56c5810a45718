"""Prometheus recording rules and alerts for the pipeline, as rule-file dictionaries.

Recording rules are named ``level:metric:operations`` (the labels kept, the metric,
what was done to it); with no group labels the level is empty, as in ``:x:rate5m``.
Every alert has a ``severity`` (critical, warning or info), a ``summary``, a
``description`` that names the labels and value that fired it, a ``runbook_url`` (one
page per alert in runbooks/) and a ``dashboard_url``. ``for`` durations are at least
one minute, long enough to ride out a missed scrape.

State gauges (backlog, dead letters, queue depths, deliveries owed) come from the
relay's state collector; several relays export the same values, so they are combined
with ``max``, never ``sum``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from textwrap import dedent
from typing import Any

from pipeline.tools.opskit.options import (
    CONSUMERS_UID,
    OVERVIEW_UID,
    RELAY_UID,
    KitOptions,
    number,
)

Rule = dict[str, Any]
RuleFile = dict[str, list[dict[str, Any]]]

SLO_WINDOWS = ("5m", "30m", "1h", "6h", "3d")


@dataclass(frozen=True)
class BurnWindow:
    """One multiwindow burn-rate alert: both windows burn faster than ``factor`` x budget."""

    long: str
    short: str
    factor: float
    wait: str
    severity: str


BURN_WINDOWS = (
    BurnWindow("1h", "5m", 14.4, "2m", "critical"),
    BurnWindow("6h", "30m", 6.0, "15m", "critical"),
    BurnWindow("3d", "6h", 1.0, "3h", "warning"),
)


def _expr(text: str) -> str:
    return dedent(text).strip()


# -- recording rules -----------------------------------------------------------------------


def recording_names(o: KitOptions) -> dict[str, str]:
    """The recording rules' names, by role (alerts refer to them through this table)."""
    top, consumer, queue = o.level(), o.level("consumer"), o.level("queue")
    names = {
        "published": f"{top}:pipeline_events_published:rate5m",
        "publish_failure_ratio": f"{top}:pipeline_publish_failures:ratio_rate5m",
        "consumer_failure_ratio": f"{consumer}:pipeline_inbox_failures:ratio_rate5m",
        "duplicate_ratio": f"{consumer}:pipeline_inbox_duplicates:ratio_rate10m",
        "redeliveries": f"{consumer}:pipeline_redeliveries:rate10m",
        "backlog": f"{top}:pipeline_outbox_backlog:sum",
        "queue_depth": f"{queue}:pipeline_queue_depth:max",
    }
    for window in SLO_WINDOWS:
        names[f"slo_{window}"] = (
            f"{top}:pipeline_end_to_end_latency_seconds:slo_miss_ratio_rate{window}"
        )
    return names


TINY = "1e-9"
"""The smallest denominator of a ratio: 0/0 reads 0, never NaN, and a ratio stays <= 1."""


def _ratio(o: KitOptions, part: str, others: tuple[str, ...], window: str, *labels: str) -> str:
    """``part / (part + others)`` over ``window``, every counter in the same unit.

    Any of ``others`` may have no series yet (``or`` falls back to those that exist); the
    denominator is clamped above 0, so an idle system reads 0 rather than NaN and the
    ratio can never exceed 1 (``part`` is in the denominator) or be infinite."""
    by = o.by(*labels)

    def rate(metric: str) -> str:
        return f"sum{by} (rate({metric}{{{o.pipeline}}}[{window}]))"

    a = rate(part)
    rest = [rate(other) for other in others]
    if len(rest) == 1:
        other = rest[0]
    else:
        alone = "".join(f"\n    or {r}" for r in rest)
        other = "(\n    " + "\n    + ".join(rest) + alone + "\n  )"
    return f"{a}\n/\nclamp_min(\n  {a}\n  + {other}\n  or {a},\n  {TINY}\n)"


PUBLISH_OUTCOMES = ("pipeline_events_published_total", "pipeline_events_unrouted_total")
"""Per-event outcomes of a claim that is not a failure: both count an event once."""


def recording_rules(o: KitOptions) -> list[Rule]:
    n = recording_names(o)
    p = o.pipeline
    rules: list[Rule] = [
        {
            "record": n["published"],
            "expr": f"sum{o.by()} (rate(pipeline_events_published_total{{{p}}}[5m]))",
        },
        {
            "record": n["publish_failure_ratio"],
            "expr": _ratio(o, "pipeline_publish_failures_total", PUBLISH_OUTCOMES, "5m"),
        },
        {
            "record": n["consumer_failure_ratio"],
            "expr": _ratio(
                o,
                "pipeline_inbox_failures_total",
                ("pipeline_inbox_processed_total",),
                "5m",
                "consumer",
            ),
        },
        {
            "record": n["duplicate_ratio"],
            "expr": _ratio(
                o,
                "pipeline_inbox_duplicates_total",
                ("pipeline_inbox_processed_total",),
                "10m",
                "consumer",
            ),
        },
        {
            "record": n["redeliveries"],
            "expr": f"sum{o.by('consumer')} (rate(pipeline_redeliveries_total{{{p}}}[10m]))",
        },
        {
            "record": n["backlog"],
            "expr": f"sum{o.by()} (max{o.by('status')} (pipeline_outbox_backlog{{{p}}}))",
        },
        {
            "record": n["queue_depth"],
            "expr": f'max{o.by("queue")} (pipeline_queue_depth{{{p}, queue!~".+[.]DQ"}})',
        },
    ]
    le = o.latency_slo_le
    for window in SLO_WINDOWS:
        rules.append(
            {
                "record": n[f"slo_{window}"],
                "expr": _expr(
                    f"""
                    1 - (
                      sum{o.by()} (rate(pipeline_end_to_end_latency_seconds_bucket{{{p}, le="{le}"}}[{window}]))
                      /
                      sum{o.by()} (rate(pipeline_end_to_end_latency_seconds_count{{{p}}}[{window}]))
                    )
                    """  # noqa: E501
                ),
            }
        )
    return rules


# -- alerts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    wait: str
    severity: str
    summary: str
    description: str
    dashboard: str = OVERVIEW_UID
    dashboard_query: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    def rule(self, o: KitOptions) -> Rule:
        rule: Rule = {"alert": self.name, "expr": self.expr}
        if self.wait:
            rule["for"] = self.wait
        rule["labels"] = {"severity": self.severity, **self.labels}
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": o.runbook(self.name),
            "dashboard_url": o.dashboard(self.dashboard, self.dashboard_query),
        }
        return rule


RELAY_CLOCK_SKEW_SECONDS = 1.0
"""How far a relay's clock may be off the database's: the delivery ledger's clock margin."""


def _down(o: KitOptions, selector: str) -> str:
    """No target of ``selector`` up: some exist but none answer, or none is scraped at all."""
    by = o.by("job")
    return (
        f"(\n  count{by} (up{{{selector}}})\n  unless\n  count{by} (up{{{selector}}} == 1)\n)\n"
        f"or\nabsent(up{{{selector}}})"
    )


def availability_alerts(o: KitOptions) -> list[Alert]:
    r = o.relay
    alerts = [
        Alert(
            "PipelineRelayDown",
            _down(o, o.relay),
            "2m",
            "critical",
            "No pipeline relay is up: nothing publishes the outbox.",
            "No target of job {{ $labels.job }} has answered a scrape for 2 minutes (or none "
            "is configured). Committed events stay in the outbox, the canary stops and the "
            "state gauges (backlog, dead letters, queue depths) are missing.",
            RELAY_UID,
        ),
        Alert(
            "PipelineWorkersDown",
            _down(o, o.worker),
            "2m",
            "critical",
            "No pipeline worker is up: no consumer handles events.",
            "No target of job {{ $labels.job }} has answered a scrape for 2 minutes (or none "
            "is configured). Events are published to Redis and wait there; consumers' queues "
            "grow.",
            CONSUMERS_UID,
        ),
        Alert(
            "PipelineTargetDown",
            f"up{{{o.pipeline}}} == 0",
            "5m",
            "warning",
            "A pipeline process does not answer scrapes.",
            "{{ $labels.job }} target {{ $labels.instance }} has failed every scrape for 5 "
            "minutes: the process is down, hung, or its metrics port is unreachable.",
            OVERVIEW_UID,
        ),
        Alert(
            "PipelineRelayListenerDown",
            f"max{o.by('job', 'instance')} (pipeline_relay_listener_connected{{{r}}}) == 0",
            "5m",
            "warning",
            "A relay's LISTEN connection is down; it publishes on its polling fallback.",
            "Relay {{ $labels.instance }} has had no LISTEN connection to Postgres for 5 "
            "minutes. Events still flow through the adaptive poll (up to "
            "PIPELINE_POLL_INTERVAL_MAX late); the relay keeps reconnecting.",
            RELAY_UID,
        ),
        Alert(
            "PipelineRelayClockSkewed",
            f"max{o.by('job', 'instance')} (abs(pipeline_relay_clock_offset_seconds{{{r}}}))"
            f" > {number(RELAY_CLOCK_SKEW_SECONDS)}",
            "5m",
            "warning",
            "A relay host's clock is more than a second off the database's.",
            "The clock of relay {{ $labels.instance }} has been {{ $value | humanize }} s "
            "off the database's for 5 minutes (as its heartbeats measure it). Queue "
            "messages carry the relay's time and the delivery ledger's sweep allows one "
            "second between clocks: beyond that it may send deliveries again that still "
            "wait on a queue (the inbox absorbs the copies), or re-send lost ones later.",
            RELAY_UID,
        ),
        Alert(
            "PipelineNotificationsMissing",
            _expr(
                f"""
                sum{o.by("job", "instance")} (increase(pipeline_relay_wakeups_total{{{r}, source="notify"}}[15m])) == 0
                and{o.on("job", "instance")}
                sum{o.by("job", "instance")} (increase(pipeline_events_published_total{{{r}}}[15m])) > 0
                and{o.on("job", "instance")}
                max{o.by("job", "instance")} (max_over_time(pipeline_relay_busy{{{r}}}[15m])) == 0
                and{o.on("job", "instance")}
                min{o.by("job", "instance")} (min_over_time(pipeline_relay_listener_connected{{{r}}}[15m])) == 1
                """  # noqa: E501
            ),
            "5m",
            "warning",
            "A relay finds work only by polling: NOTIFY never wakes it.",
            "Relay {{ $labels.instance }} published events in the last 15 minutes while idle "
            "and listening, yet received no notification: the outbox trigger is missing, "
            "the relay listens on another channel or database, or a pooler drops "
            "notifications. Events wait up to PIPELINE_POLL_INTERVAL_MAX.",
            RELAY_UID,
        ),
        Alert(
            "PipelinePostgresUnreachable",
            f'max{o.by("source")} (pipeline_state_up{{{r}, source="postgres"}}) == 0',
            "2m",
            "critical",
            "The relay cannot read Postgres.",
            "The relay's state collector has failed to read {{ $labels.source }} for 2 "
            "minutes: relays "
            "cannot publish, workers cannot record outcomes, and the backlog, dead-letter "
            "and ledger gauges are missing.",
            OVERVIEW_UID,
        ),
        Alert(
            "PipelineRedisUnreachable",
            f'max{o.by("source", "transport")} (pipeline_state_up{{{r}, source="redis"}}) == 0',
            "2m",
            "critical",
            "The relay cannot read the message broker ({{ $labels.transport }}).",
            "The relay's state collector has failed to read the message broker "
            "({{ $labels.transport }}) for 2 minutes: nothing is "
            "delivered to consumers (publishing retries and backs off) and the queue-depth "
            "gauges are missing.",
            OVERVIEW_UID,
        ),
        Alert(
            "PipelineStateMetricsStale",
            f"time() - max{o.by()} (pipeline_state_metrics_last_success_timestamp_seconds{{{r}}})"
            f" > {number(o.state_metrics_stale_seconds)}",
            "2m",
            "warning",
            f"The relay's state metrics are more than {number(o.state_metrics_stale_seconds)} s "
            "old.",
            "The relays' state collector last read Postgres and Redis successfully "
            "{{ $value | humanizeDuration }} ago: the backlog, dead-letter, queue-depth and "
            "ledger gauges show old values. Postgres or Redis is slow or unreachable, or the "
            "collector is stuck.",
            RELAY_UID,
        ),
        Alert(
            "PipelineStateMetricsAbsent",
            _expr(
                f"""
                count{o.by()} (up{{{r}}} == 1)
                unless{o.on()}
                count{o.by()} (pipeline_state_metrics_last_success_timestamp_seconds{{{r}}})
                """
            ),
            "5m",
            "warning",
            "Relays are up but none exports the state metrics.",
            "{{ $value }} relay targets answer scrapes, yet none has exported "
            "pipeline_state_metrics_last_success_timestamp_seconds for 5 minutes: every running "
            "relay has --no-state-metrics (the one without it died), or runs a version without "
            "state metrics. The backlog, dead-letter, queue-depth and ledger gauges and their "
            "alerts are missing.",
            RELAY_UID,
        ),
    ]
    listener = {"PipelineRelayListenerDown", "PipelineNotificationsMissing"}
    return [alert for alert in alerts if o.listen or alert.name not in listener]


def flow_alerts(o: KitOptions) -> list[Alert]:
    n = recording_names(o)
    p = o.pipeline
    u = p + o.routed_only  # event types sent to no consumer on purpose are left out
    alerts = [
        Alert(
            "PipelineOutboxBacklogGrowing",
            f"{n['backlog']} > {number(o.backlog_threshold)}\nand\nderiv({n['backlog']}[15m]) > 0",
            "15m",
            "warning",
            "The outbox backlog keeps growing.",
            "{{ $value | humanize }} events wait in the outbox and the number has grown for "
            "15 minutes: producers commit faster than the relays publish.",
            RELAY_UID,
        ),
        Alert(
            "PipelineOldestPendingEventTooOld",
            f"max{o.by()} (pipeline_outbox_oldest_pending_age_seconds{{{p}}}) "
            f"> {number(o.oldest_pending_seconds)}",
            "5m",
            "warning",
            f"An outbox event has waited more than {number(o.oldest_pending_seconds)} s to be "
            "published.",
            "The oldest unsent outbox event is {{ $value | humanizeDuration }} old: publishing "
            "is stuck or an event keeps failing (it also holds back later events of its "
            "ordering key).",
            RELAY_UID,
        ),
        Alert(
            "PipelinePublishFailureRatioHigh",
            f"{n['publish_failure_ratio']} > {number(o.publish_failure_ratio)}",
            "10m",
            "warning",
            f"More than {o.publish_failure_ratio:.0%} of publish attempts fail.",
            "{{ $value | humanizePercentage }} of the events the relays tried to publish over "
            "the last 5 minutes failed (an event counts once per attempt, whatever its number "
            "of consumers); failed events are retried with backoff and dead-lettered after "
            "PIPELINE_PUBLISH_MAX_ATTEMPTS.",
            RELAY_UID,
        ),
        Alert(
            "PipelineDeadLettersWaiting",
            f"max{o.by('stage')} (pipeline_dead_letters_waiting{{{p}}}) > 0",
            "1m",
            "warning",
            "Dead letters are waiting for an operator.",
            "{{ $value | humanize }} dead letters at the {{ $labels.stage }} stage have not "
            "been replayed: inspect them with `pipeline dlq list --stage {{ $labels.stage }}`, "
            "fix the cause, then replay or purge them.",
            OVERVIEW_UID,
        ),
        Alert(
            "PipelineConsumerFailureRatioHigh",
            f"{n['consumer_failure_ratio']} > {number(o.consumer_failure_ratio)}",
            "10m",
            "warning",
            f"A consumer's handler fails more than {o.consumer_failure_ratio:.0%} of its attempts.",
            "Consumer {{ $labels.consumer }} failed {{ $value | humanizePercentage }} of its "
            "handler attempts over the last 5 minutes; its events are retried with backoff "
            "and dead-lettered when retries run out.",
            CONSUMERS_UID,
            "var-consumer={{ $labels.consumer }}",
        ),
        Alert(
            "PipelineConsumerQueueGrowing",
            f"{n['queue_depth']} > {number(o.queue_depth_threshold)}\n"
            f"and\nderiv({n['queue_depth']}[15m]) > 0",
            "15m",
            "warning",
            "A consumer queue keeps growing.",
            "Queue {{ $labels.queue }} holds {{ $value | humanize }} messages (each a run of "
            "events) and has grown for 15 minutes: its workers are too few, too slow, or "
            "stuck.",
            CONSUMERS_UID,
        ),
        Alert(
            "PipelineRedeliveriesSpiking",
            f"{n['redeliveries']} > {number(o.redeliveries_per_second)}",
            "5m",
            "warning",
            "The relay is re-delivering events a consumer never finished.",
            "The ledger sweep re-delivers {{ $value | humanize }} events/s to consumer "
            "{{ $labels.consumer }} (10-minute average): deliveries got no outcome within "
            "PIPELINE_REDELIVERY_HORIZON_SECONDS (Redis lost them, or workers dropped them).",
            CONSUMERS_UID,
            "var-consumer={{ $labels.consumer }}",
        ),
        Alert(
            "PipelineDuplicateRatioHigh",
            f"{n['duplicate_ratio']} > {number(o.duplicate_ratio)}",
            "15m",
            "warning",
            "A consumer receives many duplicate deliveries.",
            "{{ $value | humanizePercentage }} of the deliveries to consumer "
            "{{ $labels.consumer }} over 10 minutes were events it had already finished. The "
            "inbox absorbs them, but they cost work and point at a redelivery storm.",
            CONSUMERS_UID,
            "var-consumer={{ $labels.consumer }}",
        ),
        Alert(
            "PipelineDeliveriesOwed",
            f"max{o.by('consumer')} (pipeline_deliveries_owed{{{p}}}) > 0",
            "15m",
            "warning",
            "A consumer has owed deliveries for 15 minutes.",
            "{{ $value | humanize }} events sent to consumer {{ $labels.consumer }} have had no "
            "outcome past the redelivery horizon for 15 minutes, although the ledger sweep "
            "sends them again: no worker runs this consumer, or its queue is stuck.",
            CONSUMERS_UID,
            "var-consumer={{ $labels.consumer }}",
        ),
        Alert(
            "PipelineCanaryStale",
            _expr(
                f"""
                time() - max{o.by()} (pipeline_canary_last_success_timestamp_seconds{{{p}}})
                > {number(o.canary_stale_seconds)}
                """
            ),
            "2m",
            "critical",
            "No canary event has crossed the pipeline for over "
            f"{number(o.canary_stale_seconds)} s.",
            "The last canary event completed the whole path {{ $value | humanizeDuration }} "
            "ago (a very large value means never since the workers started). Something "
            "between the relay's insert and the worker's handler is stuck.",
            OVERVIEW_UID,
        ),
        Alert(
            "PipelineEventsUnrouted",
            _expr(
                f"""
                sum{o.by("event_type")} (increase(pipeline_events_unrouted_total{{{u}}}[10m])) > 0
                or
                sum{o.by("event_type")} (
                  pipeline_events_unrouted_total{{{u}}}
                  unless
                  pipeline_events_unrouted_total{{{u}}} offset 10m
                ) > 0
                """
            ),
            "1m",
            "warning",
            "Events were marked sent although no consumer subscribes to their type.",
            "{{ $value | humanize }} events of type {{ $labels.event_type }} went to no consumer "
            "in the last 10 minutes: a relay or publishing worker runs without the "
            "PIPELINE_APP_MODULES that register their consumers, or a consumer was removed. "
            "Nothing re-sends them by itself.",
            RELAY_UID,
        ),
        Alert(
            "PipelineUnauthenticMessages",
            _expr(
                f"""
                sum{o.by("consumer", "reason")} (increase(pipeline_unauthentic_messages_total{{{o.worker}}}[10m])) > 0
                or
                sum{o.by("consumer", "reason")} (
                  pipeline_unauthentic_messages_total{{{o.worker}}}
                  unless
                  pipeline_unauthentic_messages_total{{{o.worker}}} offset 10m
                ) > 0
                """  # noqa: E501
            ),
            "1m",
            "critical",
            "Workers refused messages whose signature is missing or wrong.",
            "{{ $value | humanize }} messages to consumer {{ $labels.consumer }} were refused "
            "in the last 10 minutes ({{ $labels.reason }}) and dead-lettered unhandled: "
            "someone writes to the broker who should not, or relays and workers run with "
            "different PIPELINE_MESSAGE_KEY values.",
            CONSUMERS_UID,
            "var-consumer={{ $labels.consumer }}",
        ),
    ]
    return [alert for alert in alerts if o.canary or alert.name != "PipelineCanaryStale"]


def slo_alerts(o: KitOptions) -> list[Alert]:
    n = recording_names(o)
    budget = o.error_budget
    target = f"{o.latency_slo_target:.2%}".replace(".00%", "%")
    alerts = []
    for w in BURN_WINDOWS:
        threshold = f"({w.factor} * {budget})"
        alerts.append(
            Alert(
                "PipelineLatencyBudgetBurn",
                f"{n['slo_' + w.long]} > {threshold}\nand{o.on() if o.group_labels else ''}\n"
                f"{n['slo_' + w.short]} > {threshold}",
                w.wait,
                w.severity,
                "Events take too long end to end: the latency SLO's error budget burns fast.",
                f"{{{{ $value | humanizePercentage }}}} of events took longer than "
                f"{o.latency_slo_seconds:g} s from outbox insert to handler commit over the "
                f"last {w.long}, and over the last {w.short} too: {w.factor:g}x the rate that "
                f"spends the whole budget of the SLO ({target} within "
                f"{o.latency_slo_seconds:g} s over 30 days).",
                OVERVIEW_UID,
                labels={"long_window": w.long, "short_window": w.short},
            )
        )
    return alerts


def watchdog(o: KitOptions) -> Alert:
    return Alert(
        "PipelineWatchdog",
        "vector(1)",
        "",
        "info",
        "Always firing: proves that the alerting pipeline works.",
        "This alert always fires. Route it to a dead man's switch: when it stops arriving, "
        "Prometheus, its rules or Alertmanager are broken.",
        OVERVIEW_UID,
    )


def all_alerts(o: KitOptions) -> list[Alert]:
    return [*availability_alerts(o), *flow_alerts(o), *slo_alerts(o), watchdog(o)]


def recording_rule_file(o: KitOptions) -> RuleFile:
    return {"groups": [{"name": "pipeline.rules", "rules": recording_rules(o)}]}


def alert_rule_file(o: KitOptions) -> RuleFile:
    return {
        "groups": [
            {"name": "pipeline.availability", "rules": [a.rule(o) for a in availability_alerts(o)]},
            {"name": "pipeline.flow", "rules": [a.rule(o) for a in flow_alerts(o)]},
            {"name": "pipeline.slo", "rules": [a.rule(o) for a in slo_alerts(o)]},
            {"name": "pipeline.meta", "rules": [watchdog(o).rule(o)]},
        ]
    }
