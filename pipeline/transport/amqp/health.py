"""``pipeline doctor``'s checks of RabbitMQ.

* **rabbitmq**: reachable over AMQP (with the round trip of opening a channel);
* **rabbitmq_confirms**: publisher confirms are always on (stated, with the confirm timeout);
* **rabbitmq_queues**: every queue under the namespace is a quorum queue (a problem naming
  each classic one: it is not replicated and its node's loss loses its messages);
* **rabbitmq_consumer_timeout**: the server's ``consumer_timeout`` (as
  ``PIPELINE_BROKER_CONSUMER_TIMEOUT_MS`` states it) must exceed the longest a worker holds
  a message unacknowledged while running it (the longest handler time limit); past it
  RabbitMQ closes the channel and delivers the message again. Delayed messages are held at
  most half the timeout (see :mod:`.broker`), so delays of any length pass;
* **rabbitmq_cluster**: the cluster's members running; a problem when a majority is not.

The queue and cluster checks need the management API; without it they say so (info).
"""

from __future__ import annotations

import time

import pika
import pika.exceptions

from pipeline.config import Settings
from pipeline.errors import ServiceUnavailableError
from pipeline.redaction import redact_url
from pipeline.transport.amqp.broker import connect
from pipeline.transport.amqp.management import Management
from pipeline.transport.base import BrokerDiagnosis


def diagnose(settings: Settings, longest_hold_ms: int) -> BrokerDiagnosis:
    found = BrokerDiagnosis()
    url = settings.require_broker_url()
    shown = redact_url(url)
    try:
        start = time.perf_counter()
        connection = connect(url, 5.0)
        try:
            channel_start = time.perf_counter()
            connection.channel().close()
            rtt = time.perf_counter() - channel_start
        finally:
            connection.close()
        connect_time = channel_start - start
    except (pika.exceptions.AMQPError, OSError) as exc:
        found.add(
            "rabbitmq",
            "problem",
            f"cannot reach RabbitMQ at {shown}: {type(exc).__name__}",
            "start RabbitMQ or fix PIPELINE_BROKER_URL",
        )
        return found
    found.round_trip = rtt
    found.add(
        "rabbitmq",
        "ok",
        f"RabbitMQ at {shown} answers (connect {connect_time * 1000:.1f} ms, "
        f"channel round trip {rtt * 1000:.1f} ms)",
    )
    found.add(
        "rabbitmq_confirms",
        "ok",
        "publisher confirms on every publish: the relay marks events sent only once RabbitMQ "
        f"confirmed them (waits up to PIPELINE_BROKER_CONFIRM_TIMEOUT="
        f"{settings.broker_confirm_timeout:g}s)",
    )
    _check_consumer_timeout(settings, longest_hold_ms, found)
    management = Management.for_settings(settings)
    try:
        queues = management.queues()
        nodes = management.nodes()
    except ServiceUnavailableError as exc:
        found.add(
            "rabbitmq_queues",
            "info",
            f"queue types and cluster members not checked: {exc}",
            "enable the management plugin (rabbitmq-plugins enable rabbitmq_management) or "
            "set PIPELINE_BROKER_MANAGEMENT_URL",
        )
        return found
    _check_queues(settings, queues, found)
    _check_cluster(nodes, found)
    return found


def _check_consumer_timeout(
    settings: Settings, longest_hold_ms: int, found: BrokerDiagnosis
) -> None:
    timeout = settings.broker_consumer_timeout_ms
    if timeout <= longest_hold_ms:
        found.add(
            "rabbitmq_consumer_timeout",
            "problem",
            f"consumer_timeout {timeout} ms (PIPELINE_BROKER_CONSUMER_TIMEOUT_MS) is not above "
            f"the longest a worker holds a message ({longest_hold_ms} ms: a handler's time "
            "limit or the relay's lease): RabbitMQ would close the channel and deliver it "
            "again",
            f"raise consumer_timeout in rabbitmq.conf above {longest_hold_ms} ms and set "
            "PIPELINE_BROKER_CONSUMER_TIMEOUT_MS to it, or lower the handlers' time limits",
        )
    else:
        found.add(
            "rabbitmq_consumer_timeout",
            "ok",
            f"consumer_timeout {timeout} ms is above the longest a worker holds a message "
            f"({longest_hold_ms} ms)",
        )


def _check_queues(
    settings: Settings, queues: list[dict[str, object]], found: BrokerDiagnosis
) -> None:
    prefix = f"{settings.redis_namespace}."
    ours = [q for q in queues if str(q.get("name", "")).startswith(prefix)]
    classic = sorted(str(q["name"]) for q in ours if q.get("type") != "quorum")
    if not ours:
        found.add(
            "rabbitmq_queues",
            "info",
            f"no queue under {prefix}* yet (workers and the relay declare them as quorum queues)",
        )
    elif classic:
        found.add(
            "rabbitmq_queues",
            "problem",
            f"{len(classic)} of {len(ours)} queues are not quorum queues (not replicated; "
            f"their node's loss loses their messages): {', '.join(classic)}",
            "drain them, delete them, and let the pipeline declare them again as quorum queues",
        )
    else:
        found.add(
            "rabbitmq_queues", "ok", f"all {len(ours)} queues under {prefix}* are quorum queues"
        )


def _check_cluster(nodes: list[dict[str, object]], found: BrokerDiagnosis) -> None:
    running = sorted(str(n["name"]) for n in nodes if n.get("running"))
    down = sorted(str(n["name"]) for n in nodes if not n.get("running"))
    majority = len(nodes) // 2 + 1
    if len(running) < majority:
        found.add(
            "rabbitmq_cluster",
            "problem",
            f"{len(running)} of {len(nodes)} cluster members running (down: {', '.join(down)}): "
            "no majority, so quorum queues accept and deliver nothing",
            "start the members that are down",
        )
    elif down:
        found.add(
            "rabbitmq_cluster",
            "info",
            f"{len(running)} of {len(nodes)} cluster members running (down: {', '.join(down)}); "
            "a majority remains, so quorum queues keep working",
            "start the members that are down before another one fails",
        )
    else:
        single = " (a single node: quorum queues are not replicated)" if len(nodes) == 1 else ""
        found.add("rabbitmq_cluster", "ok", f"all {len(nodes)} cluster members running{single}")
