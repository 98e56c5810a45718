"""The pipeline's Grafana dashboards: an overview and drill-downs for the relay and consumers.

The overview answers the on-call's four questions at a glance (is it flowing, how far
behind, what is failing, what is dead-lettered); the drill-downs break the same
metrics down by relay instance, event type, consumer and error class. Every query
filters on the ``job`` and ``instance`` variables, rates use ``$__rate_interval``,
counters appear only under ``rate``/``increase``, and series that exist only once
something happened (failures, dead letters, re-deliveries) fall back to
``vector(0)`` so that no panel is empty in normal operation.
"""

from __future__ import annotations

import json
from urllib.parse import quote

from pipeline.tools.opskit.grafana import (
    Json,
    Link,
    Query,
    Row,
    dashboard,
    datasource_variable,
    query_variable,
    stat,
    textbox_variable,
    timeseries,
)
from pipeline.tools.opskit.options import CONSUMERS_UID, OVERVIEW_UID, RELAY_UID, KitOptions
from pipeline.tools.opskit.rules import PUBLISH_OUTCOMES, TINY

J = 'job=~"$job", instance=~"$instance"'
C = f'{J}, consumer=~"$consumer"'
RATE = "[$__rate_interval]"
RED = ((None, "green"), (1, "red"))


def _rate(metric: str, selector: str = J) -> str:
    return f"rate({metric}{{{selector}}}{RATE})"


def _sum_rate(metric: str, by: str = "", selector: str = J) -> str:
    clause = f" by ({by})" if by else ""
    return f"sum{clause} ({_rate(metric, selector)})"


RELAYS_ONLY = (
    f"and on (instance) group by (instance) (rate(pipeline_relay_wakeups_total{{{J}}}{RATE}))"
)
"""Keeps the series of relay processes (workers export the relay's gauges at 0 too)."""


def _quantile(q: float, histogram: str, by: str = "", selector: str = J) -> Query:
    labels = ", ".join(["le", *([by] if by else [])])
    expr = f"histogram_quantile({q}, sum by ({labels}) ({_rate(histogram + '_bucket', selector)}))"
    legend = f"p{round(q * 100):d}" + (f" {{{{{by}}}}}" if by else "")
    return Query(expr, legend)


def _ratio(part: str, others: tuple[str, ...], by: str = "", selector: str = J) -> str:
    """part / (part + others) in the same unit; others possibly absent. The denominator is
    clamped above 0 (an idle system reads 0, not NaN); with no ``part`` series yet, the
    ratio is 0 for each label set of the first of ``others`` (no unlabelled extra series)."""
    a = _sum_rate(part, by, selector)
    rest = [_sum_rate(other, by, selector) for other in others]
    other = rest[0] if len(rest) == 1 else f"({' + '.join(rest)} or {' or '.join(rest)})"
    zero = f"{rest[0]} * 0" if by else "on() vector(0)"
    return f"{a} / clamp_min({a} + {other} or {a}, {TINY}) or {zero}"


def _variables(o: KitOptions, *extra: Json) -> list[Json]:
    """Data source, the group labels', job and instance variables (each narrowed by those
    before it: ``_group_matchers`` adds the group labels to ``$job`` selectors), the
    dashboard's own, and the trace UI's base URL."""
    jobs = f'job=~"{o.jobs_regex}"'
    variables = [datasource_variable()]
    for index, label in enumerate(o.group_labels):
        before = "".join(f', {g}=~"${g}"' for g in o.group_labels[:index])
        query = f"label_values(up{{{jobs}{before}}}, {label})"
        variables.append(query_variable(label, label.title(), query))
    groups = "".join(f', {g}=~"${g}"' for g in o.group_labels)
    variables += [
        query_variable("job", "Job", f"label_values(up{{{jobs}{groups}}}, job)"),
        query_variable("instance", "Instance", 'label_values(up{job=~"$job"}, instance)'),
    ]
    return [*variables, *extra, textbox_variable("trace_ui", "Trace UI", o.trace_ui_url)]


def _group_matchers(board: Json, o: KitOptions) -> Json:
    """Every selector that filters on ``$job`` filters on the group labels' variables too."""
    if not o.group_labels:
        return board
    groups = "".join(f'{label}=~\\"${label}\\", ' for label in o.group_labels)
    text = json.dumps(board).replace('job=~\\"$job\\"', groups + 'job=~\\"$job\\"')
    return dict(json.loads(text))


def _without(rows: list[Row], titles: set[str]) -> list[Row]:
    """The rows without the panels of features a deployment turned off."""
    return [Row(row.title, [p for p in row.panels if p.title not in titles]) for row in rows]


CANARY_PANELS = {"Canary age", "Canary latency"}


def _runbook(o: KitOptions, name: str) -> Link:
    return Link(f"Runbook: {name}", o.runbook(name))


def _traces(title: str, service: str, **params: str) -> Link:
    """A data link to the trace UI's search (Jaeger's URL form; Tempo and others differ)."""
    query = "&".join([f"service={service}", *(f"{k}={v}" for k, v in params.items())])
    return Link(title, f"${{trace_ui}}/search?{query}")


def _tags(**tags: str) -> str:
    body = ",".join(f'"{key}":"{value}"' for key, value in tags.items())
    return quote("{" + body + "}", safe="${}._")


# -- overview -------------------------------------------------------------------------------


def overview(o: KitOptions) -> Json:
    flowing = Row(
        "Is it flowing?",
        [
            stat(
                "Published",
                "Events the broker accepted per second (every copy delivered to Redis).",
                "eps",
                Query(f"{_sum_rate('pipeline_events_published_total')} or on() vector(0)"),
            ),
            stat(
                "Processed",
                "Events whose handler committed per second, all consumers together.",
                "eps",
                Query(f"{_sum_rate('pipeline_inbox_processed_total')} or on() vector(0)"),
            ),
            stat(
                "Canary age",
                "Seconds since a canary event last crossed the whole path (relay insert to "
                f"worker handler). Above {o.canary_stale_seconds:g} s the PipelineCanaryStale "
                "alert fires.",
                "s",
                Query(f"time() - max(pipeline_canary_last_success_timestamp_seconds{{{J}}})"),
                thresholds=(
                    (None, "green"),
                    (o.canary_stale_seconds / 2, "orange"),
                    (o.canary_stale_seconds, "red"),
                ),
                links=[_runbook(o, "PipelineCanaryStale")],
            ),
            stat(
                "Backlog",
                "Outbox events not yet sent (pending and publishing).",
                "short",
                Query(f"sum(max by (status) (pipeline_outbox_backlog{{{J}}}))"),
                thresholds=((None, "green"), (o.backlog_threshold, "orange")),
                links=[_runbook(o, "PipelineOutboxBacklogGrowing")],
            ),
            stat(
                "Oldest pending",
                "Age of the oldest outbox event not yet sent; 0 when none waits.",
                "s",
                Query(f"max(pipeline_outbox_oldest_pending_age_seconds{{{J}}})"),
                thresholds=(
                    (None, "green"),
                    (o.oldest_pending_seconds / 10, "orange"),
                    (o.oldest_pending_seconds, "red"),
                ),
                links=[_runbook(o, "PipelineOldestPendingEventTooOld")],
            ),
            stat(
                "Dead letters waiting",
                "Dead letters of both stages not yet replayed or purged: each needs an "
                "operator (see the replay playbook).",
                "short",
                Query(f"sum(max by (stage) (pipeline_dead_letters_waiting{{{J}}}))"),
                thresholds=RED,
                links=[
                    _runbook(o, "PipelineDeadLettersWaiting"),
                    _runbook(o, "replay-dead-letters"),
                ],
            ),
        ],
    )
    behind = Row(
        "How far behind?",
        [
            timeseries(
                "Throughput by stage",
                "Events per second at each stage: published to the broker by relays and "
                "publishing actors, processed by consumers (one event with three consumers "
                "counts three times here).",
                "eps",
                Query(
                    f"{_sum_rate('pipeline_events_published_total')} or on() vector(0)", "published"
                ),
                Query(
                    f"{_sum_rate('pipeline_inbox_processed_total')} or on() vector(0)", "processed"
                ),
                width=8,
            ),
            timeseries(
                "Outbox backlog",
                "Outbox events not yet sent, by status; 'pending' includes events waiting "
                "for a retry.",
                "short",
                Query(f"max by (status) (pipeline_outbox_backlog{{{J}}})", "{{status}}"),
                width=8,
                links=[_runbook(o, "outbox-growing"), _runbook(o, "PipelineOutboxBacklogGrowing")],
            ),
            timeseries(
                "Oldest pending event age",
                "Age of the oldest outbox event not yet sent. A steady climb means publishing "
                "is stuck or one event keeps failing.",
                "s",
                Query(f"max(pipeline_outbox_oldest_pending_age_seconds{{{J}}})", "oldest pending"),
                width=8,
                links=[_runbook(o, "PipelineOldestPendingEventTooOld")],
            ),
            timeseries(
                "Publish lag",
                "Outbox insert to broker accepted, percentiles over all event types.",
                "s",
                _quantile(0.5, "pipeline_publish_lag_seconds"),
                _quantile(0.9, "pipeline_publish_lag_seconds"),
                _quantile(0.99, "pipeline_publish_lag_seconds"),
                width=8,
                data_links=[_traces("Relay send spans", "pipeline-relay")],
            ),
            timeseries(
                "End-to-end latency",
                f"Outbox insert to handler commit, percentiles over all consumers. The SLO: "
                f"{o.latency_slo_target:.0%} within {o.latency_slo_seconds:g} s.",
                "s",
                _quantile(0.5, "pipeline_end_to_end_latency_seconds"),
                _quantile(0.9, "pipeline_end_to_end_latency_seconds"),
                _quantile(0.99, "pipeline_end_to_end_latency_seconds"),
                width=8,
                links=[_runbook(o, "PipelineLatencyBudgetBurn")],
                data_links=[
                    _traces(
                        "Slow handler traces",
                        "pipeline-worker",
                        minDuration=f"{o.latency_slo_seconds:g}s",
                    )
                ],
            ),
            timeseries(
                "Queue depth",
                "Dramatiq messages waiting per queue (each carries a run of events); "
                "Queues whose names end in DQ hold delayed retries.",
                "short",
                Query(f"max by (queue) (pipeline_queue_depth{{{J}}})", "{{queue}}"),
                width=8,
                links=[_runbook(o, "PipelineConsumerQueueGrowing")],
            ),
        ],
    )
    failing = Row(
        "What is failing?",
        [
            timeseries(
                "Publish failure ratio",
                "Share of the events the relays tried to publish whose attempt failed (an "
                "event counts once per attempt, whatever its number of consumers; retried with "
                "backoff, dead-lettered after the last attempt).",
                "percentunit",
                Query(
                    _ratio("pipeline_publish_failures_total", PUBLISH_OUTCOMES),
                    "failed attempts",
                ),
                width=8,
                links=[_runbook(o, "PipelinePublishFailureRatioHigh")],
            ),
            timeseries(
                "Handler failure and retry ratios",
                "Share of handler attempts that raised, and share scheduled for another try, "
                "over all consumers.",
                "percentunit",
                Query(
                    _ratio("pipeline_inbox_failures_total", ("pipeline_inbox_processed_total",)),
                    "failed",
                ),
                Query(
                    _ratio("pipeline_inbox_retries_total", ("pipeline_inbox_processed_total",)),
                    "retried",
                ),
                width=8,
                links=[_runbook(o, "PipelineConsumerFailureRatioHigh")],
            ),
            timeseries(
                "Duplicate ratio",
                "Share of deliveries the inboxes absorbed because the event was already "
                "finished (at-least-once delivery at work; a spike is a redelivery storm).",
                "percentunit",
                Query(
                    _ratio("pipeline_inbox_duplicates_total", ("pipeline_inbox_processed_total",)),
                    "duplicates",
                ),
                width=8,
                links=[_runbook(o, "redelivery-storm"), _runbook(o, "PipelineDuplicateRatioHigh")],
            ),
            timeseries(
                "Re-deliveries and infrastructure retries",
                "Deliveries the relay's ledger sweep sent again (no outcome within the "
                "horizon), and messages workers retried after a database or broker failure.",
                "eps",
                Query(
                    f"{_sum_rate('pipeline_redeliveries_total')} or on() vector(0)", "re-delivered"
                ),
                Query(
                    f"{_sum_rate('pipeline_inbox_infrastructure_retries_total')} or on() vector(0)",
                    "infrastructure retries",
                ),
                width=8,
                links=[_runbook(o, "PipelineRedeliveriesSpiking")],
            ),
            timeseries(
                "Deliveries owed",
                "Per consumer: sent events with no outcome past the redelivery horizon. The "
                "sweep sends them again; a value that stays up means no worker runs the "
                "consumer.",
                "short",
                Query(f"max by (consumer) (pipeline_deliveries_owed{{{J}}})", "{{consumer}}"),
                width=8,
                links=[_runbook(o, "PipelineDeliveriesOwed")],
            ),
            timeseries(
                "Relay and listener state",
                "Relays reporting, their LISTEN connections up, and relays polling busily "
                "(producers skip NOTIFY while one is busy).",
                "short",
                Query(
                    f"count(group by (job, instance) ({_rate('pipeline_relay_wakeups_total')})) "
                    "or on() vector(0)",
                    "relays",
                ),
                Query(f"sum(pipeline_relay_listener_connected{{{J}}})", "listening"),
                Query(f"sum(pipeline_relay_busy{{{J}}})", "busy"),
                width=8,
                links=[_runbook(o, "PipelineRelayDown"), _runbook(o, "relay-down")],
            ),
        ],
    )
    dead = Row(
        "What is dead-lettered?",
        [
            timeseries(
                "Dead letters waiting by stage",
                "Dead letters not yet replayed, by stage: 'publish' (never reached the "
                "broker) or 'consume' (a handler gave up).",
                "short",
                Query(f"max by (stage) (pipeline_dead_letters_waiting{{{J}}})", "{{stage}}"),
                width=8,
                links=[_runbook(o, "poison-message"), _runbook(o, "replay-dead-letters")],
            ),
            timeseries(
                "New dead letters",
                "Events dead-lettered per interval, by stage and error class.",
                "short",
                Query(
                    "sum by (stage, error_class) "
                    f"(increase(pipeline_dead_letters_total{{{J}}}{RATE})) or on() vector(0)",
                    "{{stage}} {{error_class}}",
                ),
                width=8,
                data_links=[
                    _traces(
                        "Dead-lettered traces",
                        "pipeline-worker",
                        tags=_tags(**{"pipeline.dead_lettered": "true"}),
                    )
                ],
            ),
            timeseries(
                "Broker dead-letter sets",
                "Messages in Dramatiq's own dead-letter set per queue (messages the broker "
                "gave up on outside the pipeline's dead letters).",
                "short",
                Query(f"max by (queue) (pipeline_dead_letter_queue_depth{{{J}}})", "{{queue}}"),
                width=8,
            ),
        ],
    )
    return dashboard(
        OVERVIEW_UID,
        "Pipeline / Overview",
        "Is it flowing, how far behind, what is failing, what is dead-lettered.",
        _variables(o),
        _without([flowing, behind, failing, dead], set() if o.canary else CANARY_PANELS),
        [Link("Runbooks", o.runbook("README"))],
    )


# -- relay ----------------------------------------------------------------------------------


def relay(o: KitOptions) -> Json:
    state = Row(
        "Relays",
        [
            stat(
                "Relays reporting",
                "Relay processes whose metrics reach Prometheus.",
                "short",
                Query(
                    f"count(group by (job, instance) ({_rate('pipeline_relay_wakeups_total')})) "
                    "or on() vector(0)"
                ),
                thresholds=((None, "red"), (1, "green")),
                links=[_runbook(o, "PipelineRelayDown")],
                width=6,
            ),
            stat(
                "LISTEN connections up",
                "Relays whose LISTEN connection to Postgres is up (workers report 0).",
                "short",
                Query(f"sum(pipeline_relay_listener_connected{{{J}}})"),
                thresholds=((None, "red"), (1, "green")),
                links=[_runbook(o, "PipelineRelayListenerDown")],
                width=6,
            ),
            stat(
                "Busy relays",
                "Relays polling busily; producers skip NOTIFY while one is busy.",
                "short",
                Query(f"sum(pipeline_relay_busy{{{J}}})"),
                width=6,
            ),
            stat(
                "State sources readable",
                "Postgres and the message broker (source redis; its transport: Redis or "
                "RabbitMQ) as the relay's state collector last read them (1 up, 0 down).",
                "short",
                Query(
                    f"min by (source, transport) (pipeline_state_up{{{J}}})",
                    "{{source}} ({{transport}})",
                ),
                thresholds=((None, "red"), (1, "green")),
                links=[
                    _runbook(o, "PipelinePostgresUnreachable"),
                    _runbook(o, "PipelineRedisUnreachable"),
                ],
                width=6,
            ),
        ],
    )
    wakeups = Row(
        "Wake-ups",
        [
            timeseries(
                "Wake-ups by source",
                "Why relays woke: a NOTIFY, the adaptive poll timer, or a (re)connect of the "
                "LISTEN connection (which runs a catch-up sweep).",
                "ops",
                Query(_sum_rate("pipeline_relay_wakeups_total", "source"), "{{source}}"),
                width=8,
                links=[_runbook(o, "PipelineNotificationsMissing")],
            ),
            timeseries(
                "LISTEN connection and busy polling per relay",
                "1 while a relay's LISTEN connection is up; 1 while it polls busily.",
                "short",
                Query(
                    f"max by (instance) (pipeline_relay_listener_connected{{{J}}}) {RELAYS_ONLY}",
                    "listening {{instance}}",
                ),
                Query(
                    f"max by (instance) (pipeline_relay_busy{{{J}}}) {RELAYS_ONLY}",
                    "busy {{instance}}",
                ),
                width=8,
                links=[_runbook(o, "PipelineRelayListenerDown")],
            ),
            timeseries(
                "Listener reconnects",
                "Times the LISTEN connection was re-established per interval.",
                "short",
                Query(
                    f"sum(increase(pipeline_relay_listener_reconnects_total{{{J}}}{RATE}))",
                    "reconnects",
                ),
                width=8,
            ),
        ],
    )
    publishing = Row(
        "Publishing",
        [
            timeseries(
                "Published by event type",
                "Events the broker accepted per second, by event type.",
                "eps",
                Query(
                    _sum_rate("pipeline_events_published_total", "event_type")
                    + " or on() vector(0)",
                    "{{event_type}}",
                ),
                width=8,
            ),
            timeseries(
                "Publish attempts and failures",
                "Delivery attempts per second, and failed ones by error class.",
                "eps",
                Query(_sum_rate("pipeline_publish_attempts_total"), "attempts"),
                Query(
                    _sum_rate("pipeline_publish_failures_total", "error_class")
                    + " or on() vector(0)",
                    "failed {{error_class}}",
                ),
                width=8,
                links=[_runbook(o, "PipelinePublishFailureRatioHigh"), _runbook(o, "broker-down")],
            ),
            timeseries(
                "Unrouted events",
                "Events marked sent although no consumer subscribes to their type: nothing "
                "re-sends them by itself.",
                "eps",
                Query(
                    _sum_rate("pipeline_events_unrouted_total", "event_type")
                    + " or on() vector(0)",
                    "{{event_type}}",
                ),
                width=8,
                links=[_runbook(o, "PipelineEventsUnrouted")],
            ),
            timeseries(
                "Publish lag",
                "Outbox insert to broker accepted.",
                "s",
                _quantile(0.5, "pipeline_publish_lag_seconds"),
                _quantile(0.99, "pipeline_publish_lag_seconds"),
                width=8,
                data_links=[_traces("Relay send spans", "pipeline-relay")],
            ),
            timeseries(
                "Publish lag p99 by event type",
                "99th percentile of the publish lag per event type.",
                "s",
                _quantile(0.99, "pipeline_publish_lag_seconds", "event_type"),
                width=8,
            ),
            timeseries(
                "Events per publishing batch",
                "Events claimed per batch: small on an idle system (each event goes at "
                "once), up to PIPELINE_BATCH_SIZE under load.",
                "short",
                _quantile(0.5, "pipeline_publish_batch_events"),
                _quantile(0.99, "pipeline_publish_batch_events"),
                width=8,
            ),
            timeseries(
                "Broker time per publishing batch",
                "Time the broker took to accept a batch, by transport: Redis's pipelined "
                "write; on RabbitMQ the publish and its publisher-confirm round (events are "
                "marked sent only after every confirm).",
                "s",
                _quantile(0.5, "pipeline_broker_publish_seconds", "transport"),
                _quantile(0.99, "pipeline_broker_publish_seconds", "transport"),
                width=8,
                links=[_runbook(o, "broker-down")],
            ),
        ],
    )
    ledger = Row(
        "Outbox and delivery ledger",
        [
            timeseries(
                "Outbox backlog",
                "Outbox events not yet sent, by status.",
                "short",
                Query(f"max by (status) (pipeline_outbox_backlog{{{J}}})", "{{status}}"),
                width=8,
                links=[_runbook(o, "PipelineOutboxBacklogGrowing")],
            ),
            timeseries(
                "Oldest pending event age",
                "Age of the oldest outbox event not yet sent.",
                "s",
                Query(f"max(pipeline_outbox_oldest_pending_age_seconds{{{J}}})", "oldest"),
                width=8,
                links=[_runbook(o, "PipelineOldestPendingEventTooOld")],
            ),
            timeseries(
                "Re-deliveries by consumer",
                "Deliveries the ledger sweep sent again because no outcome arrived within "
                "PIPELINE_REDELIVERY_HORIZON_SECONDS.",
                "eps",
                Query(
                    f"{_sum_rate('pipeline_redeliveries_total', 'consumer')} or on() vector(0)",
                    "{{consumer}}",
                ),
                width=8,
                links=[_runbook(o, "PipelineRedeliveriesSpiking")],
            ),
            timeseries(
                "Deliveries owed and ordered keys held",
                "Per consumer: deliveries with no outcome past the horizon, and ordering keys "
                "whose later events wait behind one of them.",
                "short",
                Query(f"max by (consumer) (pipeline_deliveries_owed{{{J}}})", "owed {{consumer}}"),
                Query(
                    f"max by (consumer) (pipeline_ordered_keys_held{{{J}}})", "held {{consumer}}"
                ),
                width=8,
                links=[_runbook(o, "PipelineDeliveriesOwed")],
            ),
            timeseries(
                "State refresh",
                "Time the relay's last state query took (one SQL statement, one Redis round trip).",
                "s",
                Query(f"max(pipeline_state_refresh_duration_seconds{{{J}}})", "refresh"),
                width=8,
            ),
            timeseries(
                "State metrics age",
                "Seconds since the relays' state collector last read Postgres and Redis "
                f"successfully. Above {o.state_metrics_stale_seconds:g} s "
                "PipelineStateMetricsStale fires.",
                "s",
                Query(
                    f"time() - max(pipeline_state_metrics_last_success_timestamp_seconds{{{J}}})",
                    "age",
                ),
                width=8,
                links=[_runbook(o, "PipelineStateMetricsStale")],
            ),
            timeseries(
                "State sources readable over time",
                "1 while the relay's state collector can read the source (source redis: the "
                "message broker, of the transport named).",
                "short",
                Query(
                    f"min by (source, transport) (pipeline_state_up{{{J}}})",
                    "{{source}} ({{transport}})",
                ),
                width=8,
                links=[_runbook(o, "postgres-down"), _runbook(o, "broker-down")],
            ),
            timeseries(
                "Clock offset against the database",
                "Each relay host's clock minus the database's, measured at every heartbeat "
                "(positive: the host is ahead). Beyond one second either way for 5 minutes "
                "PipelineRelayClockSkewed fires: the delivery ledger allows one second "
                "between queue messages' times and the database's.",
                "s",
                Query(
                    f"max by (instance) (pipeline_relay_clock_offset_seconds{{{J}}}) {RELAYS_ONLY}",
                    "{{instance}}",
                ),
                width=16,
                links=[_runbook(o, "PipelineRelayClockSkewed")],
            ),
        ],
    )
    return dashboard(
        RELAY_UID,
        "Pipeline / Relay",
        "Relays: wake-ups, LISTEN connection, publishing, outbox backlog and the delivery ledger.",
        _variables(o),
        [state, wakeups, publishing, ledger],
        [
            Link("Relay down playbook", o.runbook("relay-down")),
            Link("Runbooks", o.runbook("README")),
        ],
    )


# -- consumers ------------------------------------------------------------------------------


def consumers(o: KitOptions) -> Json:
    consumer_variable = query_variable(
        "consumer", "Consumer", 'label_values(pipeline_deliveries_owed{job=~"$job"}, consumer)'
    )
    failure_traces = _traces(
        "Failed handler traces",
        "pipeline-worker",
        tags=_tags(
            **{
                "messaging.consumer.group.name": "${__field.labels.consumer}",
                "error.type": "${__field.labels.error_class}",
            }
        ),
    )
    throughput = Row(
        "Throughput and failures",
        [
            timeseries(
                "Processed by consumer",
                "Events whose handler committed per second.",
                "eps",
                Query(
                    _sum_rate("pipeline_inbox_processed_total", "consumer", C)
                    + " or on() vector(0)",
                    "{{consumer}}",
                ),
                width=8,
            ),
            timeseries(
                "Handler failures by error class",
                "Handler attempts that raised per second, by consumer and exception class.",
                "eps",
                Query(
                    f"{_sum_rate('pipeline_inbox_failures_total', 'consumer, error_class', C)} "
                    "or on() vector(0)",
                    "{{consumer}} {{error_class}}",
                ),
                width=8,
                data_links=[failure_traces],
                links=[_runbook(o, "consumer-crash-loop"), _runbook(o, "poison-message")],
            ),
            timeseries(
                "Failure ratio by consumer",
                f"Share of handler attempts that raised. Above {o.consumer_failure_ratio:.0%} "
                "for 10 minutes "
                "PipelineConsumerFailureRatioHigh fires.",
                "percentunit",
                Query(
                    _ratio(
                        "pipeline_inbox_failures_total",
                        ("pipeline_inbox_processed_total",),
                        "consumer",
                        C,
                    ),
                    "{{consumer}}",
                ),
                width=8,
                links=[_runbook(o, "PipelineConsumerFailureRatioHigh")],
            ),
            timeseries(
                "Retries by consumer",
                "Failed handler attempts scheduled for another try, per second.",
                "eps",
                Query(
                    f"{_sum_rate('pipeline_inbox_retries_total', 'consumer', C)} or on() vector(0)",
                    "{{consumer}}",
                ),
                width=8,
            ),
            timeseries(
                "Infrastructure retries",
                "Messages that failed outside their handlers (database or Redis gone, "
                "connection killed) and went back to the queue.",
                "mps",
                Query(
                    f"{_sum_rate('pipeline_inbox_infrastructure_retries_total', 'consumer, error_class', C)} "  # noqa: E501
                    "or on() vector(0)",
                    "{{consumer}} {{error_class}}",
                ),
                width=8,
                links=[_runbook(o, "postgres-down"), _runbook(o, "broker-down")],
            ),
            timeseries(
                "New consume-stage dead letters",
                "Events handlers gave up on per interval, by event type and error class (all "
                "consumers: dead letters carry no consumer label).",
                "short",
                Query(
                    "sum by (event_type, error_class) (increase(pipeline_dead_letters_total"
                    f'{{{J}, stage="consume"}}{RATE})) or on() vector(0)',
                    "{{event_type}} {{error_class}}",
                ),
                width=8,
                links=[_runbook(o, "poison-message"), _runbook(o, "replay-dead-letters")],
            ),
        ],
    )
    latency = Row(
        "Latency",
        [
            timeseries(
                "Handler duration",
                "Time in one handler attempt, successful or not, by consumer.",
                "s",
                _quantile(0.5, "pipeline_handler_duration_seconds", "consumer", C),
                _quantile(0.99, "pipeline_handler_duration_seconds", "consumer", C),
                width=8,
                data_links=[
                    _traces(
                        "Slow handler traces",
                        "pipeline-worker",
                        tags=_tags(
                            **{"messaging.consumer.group.name": "${__field.labels.consumer}"}
                        ),
                        minDuration="1s",
                    )
                ],
            ),
            timeseries(
                "End-to-end latency p99",
                "Outbox insert to handler commit, 99th percentile by consumer.",
                "s",
                _quantile(0.99, "pipeline_end_to_end_latency_seconds", "consumer", C),
                width=8,
                links=[_runbook(o, "PipelineLatencyBudgetBurn")],
            ),
            timeseries(
                "Events within the latency SLO",
                f"Share of events processed within {o.latency_slo_seconds:g} s of their "
                f"outbox insert, by consumer (SLO: {o.latency_slo_target:.0%}).",
                "percentunit",
                Query(
                    "sum by (consumer) (rate(pipeline_end_to_end_latency_seconds_bucket"
                    f'{{{C}, le="{o.latency_slo_le}"}}{RATE}))\n/\n'
                    f"{_sum_rate('pipeline_end_to_end_latency_seconds_count', 'consumer', C)}",
                    "{{consumer}}",
                ),
                width=8,
            ),
        ],
    )
    delivery = Row(
        "Delivery",
        [
            timeseries(
                "Duplicate ratio",
                "Share of deliveries absorbed because the consumer had already finished the event.",
                "percentunit",
                Query(
                    _ratio(
                        "pipeline_inbox_duplicates_total",
                        ("pipeline_inbox_processed_total",),
                        "consumer",
                        C,
                    ),
                    "{{consumer}}",
                ),
                width=8,
                links=[_runbook(o, "PipelineDuplicateRatioHigh"), _runbook(o, "redelivery-storm")],
            ),
            timeseries(
                "Re-deliveries",
                "Deliveries the relay's ledger sweep sent again to the consumer.",
                "eps",
                Query(
                    f"{_sum_rate('pipeline_redeliveries_total', 'consumer', C)} or on() vector(0)",
                    "{{consumer}}",
                ),
                width=8,
                links=[_runbook(o, "PipelineRedeliveriesSpiking")],
            ),
            timeseries(
                "Deliveries owed and ordered keys held",
                "Deliveries with no outcome past the redelivery horizon, and ordering keys "
                "waiting behind one of them.",
                "short",
                Query(f"max by (consumer) (pipeline_deliveries_owed{{{C}}})", "owed {{consumer}}"),
                Query(
                    f"max by (consumer) (pipeline_ordered_keys_held{{{C}}})", "held {{consumer}}"
                ),
                width=8,
                links=[_runbook(o, "PipelineDeliveriesOwed")],
            ),
            timeseries(
                "Queue depth",
                "Messages waiting on every queue (names ending in DQ: delayed retries); a "
                "consumer's queue is named pipeline.<consumer> unless it chose another.",
                "short",
                Query(f"max by (queue) (pipeline_queue_depth{{{J}}})", "{{queue}}"),
                width=12,
                links=[_runbook(o, "PipelineConsumerQueueGrowing")],
            ),
            timeseries(
                "Canary latency",
                "Created-to-processed latency of the canary events (one every "
                "PIPELINE_CANARY_INTERVAL).",
                "s",
                _quantile(0.5, "pipeline_canary_latency_seconds"),
                _quantile(0.99, "pipeline_canary_latency_seconds"),
                width=12,
                links=[_runbook(o, "PipelineCanaryStale")],
            ),
        ],
    )
    return dashboard(
        CONSUMERS_UID,
        "Pipeline / Consumers",
        "Consumers: throughput, failures, latency, duplicates, re-deliveries and queues.",
        _variables(o, consumer_variable),
        _without([throughput, latency, delivery], set() if o.canary else CANARY_PANELS),
        [
            Link("Poison message playbook", o.runbook("poison-message")),
            Link("Runbooks", o.runbook("README")),
        ],
    )


def all_dashboards(o: KitOptions) -> dict[str, Json]:
    """File name -> dashboard JSON."""
    return {
        "pipeline-overview.json": _group_matchers(overview(o), o),
        "pipeline-relay.json": _group_matchers(relay(o), o),
        "pipeline-consumers.json": _group_matchers(consumers(o), o),
    }
