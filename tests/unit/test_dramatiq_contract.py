"""What pipeline/transport/ assumes of Dramatiq's internals, checked against the installed copy.

The Redis broker calls Dramatiq's ``dispatch`` Lua script itself (``push_dispatch``),
subclasses the private ``_RedisConsumer``, spells Dramatiq's key layout (``keys.py``) and
writes message JSON by hand (``encoding.py``); the inbox reads the private ``_exception``
of a message through ``messages.py``. A Dramatiq release that moves an argument, renames
a key, a field or an attribute fails here, before it can misroute a message; and a private
name used in ``pipeline/transport/`` without a test here fails
``test_every_private_name_the_transport_uses_is_pinned_here``. Dramatiq is pinned to the
minor series these tests passed on.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.resources
import inspect
import json
import logging
import re
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dramatiq
import dramatiq.worker
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.common import dq_name, xq_name
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message

import pipeline.transport
from pipeline.config import Settings
from pipeline.envelope import OutboxEvent, encode_envelope
from pipeline.registry import Registry
from pipeline.transport.messages import current_exception
from pipeline.transport.publisher import Delivery
from pipeline.transport.redis.broker import (
    _FETCH_WITH_IDS,
    PipelineRedisBroker,
    WakeableRedisConsumer,
    make_broker,
)
from pipeline.transport.redis.encoding import REDIS_MESSAGE_ID
from pipeline.transport.redis.keys import (
    acks_key,
    dead_set_key,
    delay_queue_key,
    heartbeats_key,
    messages_key,
    queue_key,
    queue_of_messages_key,
)
from pipeline.transport.redis.publisher import DramatiqRedisPublisher

# The names private to Dramatiq that pipeline/transport/ uses, each pinned by a test below.
DRAMATIQ_PRIVATE_NAMES = {
    "_RedisConsumer": "test_the_private_consumer_still_has_what_the_subclass_uses",
    "_should_do_maintenance": "test_the_private_consumer_still_has_what_the_subclass_uses",
    "_max_unpack_size": "test_the_private_consumer_still_has_what_the_subclass_uses",
    "_exception": "test_the_exception_that_failed_a_message_is_where_current_exception_reads",
    "_RabbitmqConsumer": "test_the_private_rabbitmq_classes_still_have_what_the_subclass_uses",
    "_RabbitmqMessage": "test_the_private_rabbitmq_classes_still_have_what_the_subclass_uses",
    "_tag": "test_the_private_rabbitmq_classes_still_have_what_the_subclass_uses",
    "_impl": "test_pikas_blocking_channel_still_has_the_channel_the_publisher_confirms_on",
}

SCRIPT = (importlib.resources.files("dramatiq.brokers") / "redis" / "dispatch.lua").read_text()
# The script's fixed arguments, in the order push_dispatch passes them.
ARGV = {
    "command": 1,
    "timestamp": 2,
    "queue_name": 3,
    "worker_id": 4,
    "heartbeat_timeout": 5,
    "dead_message_ttl": 6,
    "do_maintenance": 7,
    "max_unpack_size": 8,
}


def offline_broker() -> PipelineRedisBroker:
    """A broker that never connects: nothing here talks to Redis."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0", redis_namespace="ns")  # type: ignore[arg-type]
    return make_broker(settings, middleware=[])


def statement(pattern: str) -> re.Match[str]:
    found = re.search(pattern, SCRIPT, re.MULTILINE)
    assert found is not None, f"dispatch.lua no longer matches {pattern!r}"
    return found


def test_the_pinned_series_is_installed():
    version = importlib.metadata.version("dramatiq")
    assert version.startswith("2.2."), f"dramatiq {version}: re-check broker.py's assumptions"


def test_the_broker_sends_the_installed_dispatch_script():
    broker = offline_broker()
    sent = broker.scripts["dispatch"].script
    assert (sent.decode() if isinstance(sent, bytes) else sent) == SCRIPT


def test_the_scripts_fixed_arguments_are_where_push_dispatch_puts_them():
    positions = dict(
        (name, int(index))
        for name, index in re.findall(r"^local (\w+) = ARGV\[(\d+)\]$", SCRIPT, re.MULTILINE)
    )
    assert positions == ARGV
    statement(r"^local namespace = KEYS\[1\]$")
    statement(r"^for i=9,#ARGV do\n\s+ARGS\[i - 8\] = ARGV\[i\]$")  # command args follow

    class Recorder:  # the pipeline push_dispatch adds its call to
        def evalsha(self, *call: Any) -> None:
            self.call = call

    broker = offline_broker()
    broker._max_unpack_size = lambda: 100  # type: ignore[method-assign]  # asks Redis otherwise
    pipe = Recorder()
    broker.push_dispatch(pipe, "enqueue", "payments", "msg-id", "body", maintenance=False)
    sha, key_count, namespace, *argv = pipe.call
    assert (sha, key_count, namespace) == (broker.scripts["dispatch"].sha, 1, "ns")
    assert argv[ARGV["command"] - 1] == "enqueue"
    assert argv[ARGV["queue_name"] - 1] == "payments"
    assert argv[ARGV["worker_id"] - 1] == broker.broker_id
    assert argv[ARGV["heartbeat_timeout"] - 1] == broker.heartbeat_timeout
    assert argv[ARGV["dead_message_ttl"] - 1] == broker.dead_message_ttl
    assert argv[ARGV["do_maintenance"] - 1] == 0
    assert argv[ARGV["max_unpack_size"] - 1] == 100
    assert argv[len(ARGV) :] == ["msg-id", "body"]


def test_the_commands_take_the_arguments_the_broker_passes():
    enqueue = r"local message_id = ARGS\[1\]\n\s+local message_data = ARGS\[2\]"
    statement(r'command == "enqueue" then\n\s+' + enqueue)
    fetch = r"local prefetch = math.min\(ARGS\[1\], max_unpack_size\)"
    statement(r'command == "fetch" then\n(\s*--.*\n)*\s+' + fetch)
    statement(r'command == "ack" then\n\s+local message_id = ARGS\[1\]')


def test_the_key_layout_is_the_one_keys_computes():
    statement(r'^local acks = namespace \.\. ":__acks__\." \.\. worker_id$')
    statement(r'^local queue_acks = acks \.\. "\." \.\. queue_name$')
    statement(r'^local queue_messages = queue_full_name \.\. "\.msgs"$')
    statement(r'^local queue_full_name = namespace \.\. ":" \.\. queue_name$')
    statement(r'redis\.call\("sadd", queue_acks, message_id\)')  # fetch records it there
    # Every command records its caller's heartbeat (the ledger reads live consumers there).
    statement(r'^local heartbeats = namespace \.\. ":__heartbeats__"$')
    statement(r'^redis\.call\("zadd", heartbeats, timestamp, worker_id\)$')
    # Delayed messages are a queue of their own (<queue>.DQ); rejected ones, of both the
    # queue and its delay queue, a sorted set with a hash named after the queue.
    statement(r'^if string\.sub\(queue_name, -3\) == "\.DQ" then$')
    statement(r"^    queue_canonical_name = string\.sub\(queue_name, 1, -4\)$")
    statement(
        r'^local xqueue_full_name = namespace \.\. ":" \.\. queue_canonical_name \.\. "\.XQ"$'
    )
    statement(r'^local xqueue_messages = xqueue_full_name \.\. "\.msgs"$')
    statement(r'redis\.call\("zadd", xqueue_full_name, timestamp, message_id\)')
    assert acks_key("ns", "worker-1", "payments") == "ns:__acks__.worker-1.payments"
    assert heartbeats_key("ns") == "ns:__heartbeats__"
    assert queue_key("ns", "payments") == "ns:payments"
    assert messages_key("ns", "payments") == "ns:payments.msgs"
    assert delay_queue_key("ns", "payments") == f"ns:{dq_name('payments')}" == "ns:payments.DQ"
    assert dead_set_key("ns", "payments") == f"ns:{xq_name('payments')}" == "ns:payments.XQ"
    for key in ("ns:payments.msgs", "ns:payments.DQ.msgs", "ns:payments.XQ.msgs"):
        assert queue_of_messages_key("ns", key) == "payments"
    assert queue_of_messages_key("ns", "ns:__heartbeats__.msgs") is None
    assert queue_of_messages_key("ns", "other:payments.msgs") is None


class RecordingRedisBroker(RedisBroker):  # type: ignore[misc]
    """Dramatiq's own Redis broker, offline, recording what its enqueue hands the script."""

    def __init__(self) -> None:
        super().__init__(url="redis://127.0.0.1:1/0", namespace="ns", middleware=[])
        self.enqueued: list[tuple[str, str, bytes]] = []

    def do_enqueue(self, queue_name: str, redis_id: str, body: bytes) -> None:
        self.enqueued.append((queue_name, redis_id, body))


def test_dramatiqs_own_enqueue_writes_what_the_publisher_writes():
    """Queue, Redis id and body, in the order push_dispatch passes them to ``enqueue``;
    the id in the option the consumer acks by; delayed messages on dq_name's queue."""
    broker = RecordingRedisBroker()
    broker.declare_queue("payments")
    assert broker.get_declared_delay_queues() == {"payments.DQ"}
    sent = broker.enqueue(Message("payments", "actor", ([{"a": 1}],), {}, {}))
    delayed = broker.enqueue(Message("payments", "actor", (), {}, {}), delay=1000)
    (queue, redis_id, body), (delay_queue, _, _) = broker.enqueued
    assert queue == "payments" and delay_queue == "payments.DQ" == dq_name("payments")
    assert sent.options == {REDIS_MESSAGE_ID: redis_id}
    assert json.loads(body)["options"] == {REDIS_MESSAGE_ID: redis_id}
    assert delayed.queue_name == "payments.DQ"
    assert f'message.options["{REDIS_MESSAGE_ID}"]' in inspect.getsource(_RedisConsumer.ack)


def test_ack_and_nack_do_what_the_consumer_s_own_versions_do():
    """WakeableRedisConsumer acks and nacks with the dispatch script in its own pipeline
    (recording the id as finished first): Dramatiq's versions must still be just that."""
    for method, command in ((_RedisConsumer.ack, "ack"), (_RedisConsumer.nack, "nack")):
        source = inspect.getsource(method)
        assert f"self.broker.do_{command}(self.queue_name, message.options[" in source
        assert "self.queued_message_ids.discard(message.message_id)" in source
    statement(r'command == "nack" then\n\s+local message_id = ARGS\[1\]')


def test_the_broker_s_fetch_does_what_dramatiqs_fetch_does_and_keeps_the_ids():
    """``PipelineRedisBroker.fetch`` runs Dramatiq's fetch with a prefetch of 0 (only the
    heartbeat and maintenance every dispatch does) and then a script of its own that does
    what Dramatiq's fetch does, returning each id with its body (``test_broker.py`` runs
    both against a real Redis)."""
    fetch = statement(r'command == "fetch" then\n((.|\n)*?)\n\n\n').group(1)
    assert re.search(r"local prefetch = math.min\(ARGS\[1\], max_unpack_size\)", fetch)
    loop = r'for i=1,prefetch do\n\s+local message_id = redis.call\("lpop", queue_full_name\)'
    assert re.search(loop, fetch)  # a prefetch of 0 pops nothing
    assert re.search(r'redis\.call\("sadd", queue_acks, message_id\)', fetch)
    assert re.search(r'return redis\.call\("hmget", queue_messages, unpack\(message_ids\)\)', fetch)
    assert re.search(r"if next\(message_ids\) ~= nil then(.|\n)*else\n\s+return \{\}", fetch)
    ours = _FETCH_WITH_IDS
    assert "redis.call('lpop', KEYS[1])" in ours and "redis.call('sadd', KEYS[2], id)" in ours
    assert "redis.call('hget', KEYS[3], id)" in ours


def test_dramatiq_reads_the_redis_id_from_the_body_only_where_the_consumer_overrides_it():
    """Dramatiq settles a message by the ``redis_message_id`` its body names; the
    consumer settles it by the id it was fetched under, so every Dramatiq method that
    reads the option, but the enqueue that writes it, must be one the consumer replaces."""
    import dramatiq.brokers.redis as dramatiq_redis

    readers = {
        f"{owner.__name__}.{name}"
        for owner in (RedisBroker, _RedisConsumer)
        for name, value in vars(owner).items()
        if inspect.isfunction(value) and REDIS_MESSAGE_ID in inspect.getsource(value)
    }
    assert readers == {
        "RedisBroker.enqueue",
        "_RedisConsumer.ack",
        "_RedisConsumer.nack",
        "_RedisConsumer.requeue",
    }
    assert inspect.getsource(dramatiq_redis).count(REDIS_MESSAGE_ID) == 5
    for name in ("ack", "nack", "requeue", "__next__"):
        assert name in vars(WakeableRedisConsumer), name
    requeue = inspect.getsource(_RedisConsumer.requeue)
    assert "self.broker.do_requeue(self.queue_name, *message_ids)" in requeue


def outbox_event(payload_json: str, seq: int = 1) -> OutboxEvent:
    return OutboxEvent(
        id=uuid.uuid4(),
        seq=seq,
        aggregate_type="order",
        aggregate_id="o-1",
        ordering_key="order:o-1",
        event_type="order.placed",
        event_version=1,
        payload_json=payload_json,
        headers_json=json.dumps({"correlation_id": "c-1"}),
        attempts=0,
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )


@pytest.mark.parametrize(
    "payloads, byte_identical",
    [
        (['{"total":42}', '{"items":["a","b"]}'], True),  # compact ASCII: Dramatiq's own bytes
        (['{"total": 42, "name": "é"}'], False),  # as Postgres prints jsonb: same message
    ],
)
def test_the_message_json_the_publisher_writes_is_dramatiqs_encoding(payloads, byte_identical):
    publisher = DramatiqRedisPublisher(offline_broker(), "/pipeline/test")
    subscription = Registry().subscribe("payments", ["order.placed"])
    events = [outbox_event(payload, seq) for seq, payload in enumerate(payloads, 1)]
    redis_id, body = publisher.encode(Delivery(subscription, events))

    assert list(json.loads(body)) == [field.name for field in dataclasses.fields(Message)]
    decoded = Message.decode(body.encode())
    meant = Message(
        queue_name=subscription.queue,
        actor_name=subscription.actor_name,
        args=([json.loads(encode_envelope(event, "/pipeline/test")) for event in events],),
        kwargs={},
        options={REDIS_MESSAGE_ID: redis_id},
        message_id=decoded.message_id,
        message_timestamp=decoded.message_timestamp,
    )
    assert decoded == meant
    assert [envelope["data"] for envelope in decoded.args[0]] == [json.loads(p) for p in payloads]
    assert str(uuid.UUID(decoded.message_id)) == decoded.message_id != redis_id
    now_ms = datetime.now(UTC).timestamp() * 1000
    assert now_ms - 60_000 < decoded.message_timestamp <= now_ms
    assert Message.decode(decoded.encode()) == decoded  # round-trips through Dramatiq
    assert (meant.encode() == body.encode()) is byte_identical


def test_the_private_consumer_still_has_what_the_subclass_uses():
    assert issubclass(WakeableRedisConsumer, _RedisConsumer)
    assert issubclass(_RedisConsumer, dramatiq.Consumer)
    assert list(inspect.signature(_RedisConsumer).parameters) == [
        "broker",
        "queue_name",
        "prefetch",
        "timeout",
    ]
    consumer = _RedisConsumer(offline_broker(), "payments", 4, 100)
    assert (consumer.queue_name, consumer.prefetch, consumer.timeout) == ("payments", 4, 100)
    assert consumer.message_cache == [] and consumer.queued_message_ids == set()
    assert consumer.misses == 0
    assert consumer.outstanding_message_count == 0
    consumer.message_cache = [(b"id", b"x")]  # ours holds (Redis id, body) pairs
    consumer.queued_message_ids.add("m")
    assert consumer.outstanding_message_count == 2  # both count against the prefetch
    assert list(inspect.signature(_RedisConsumer.requeue).parameters) == ["self", "messages"]
    broker = offline_broker()
    for name in ("broker_id", "namespace", "heartbeat_timeout", "dead_message_ttl", "client"):
        assert hasattr(broker, name), name
    assert list(inspect.signature(RedisBroker._should_do_maintenance).parameters) == [
        "self",
        "command",
    ]
    assert broker._should_do_maintenance("enqueue") in (0, 1)
    assert list(inspect.signature(RedisBroker._max_unpack_size).parameters) == ["self"]
    assert "consumer_class" in vars(RedisBroker)  # the property the broker overrides


def test_the_subclasses_override_no_private_method_by_accident():
    """A Dramatiq release adding a private method of the same name would be shadowed.

    Only what the class body defines counts: Dramatiq itself caches values on the class of
    the broker it runs in (``_max_unpack_size`` sets ``type(self)._max_unpack_size_val``),
    so after any test in this process used a real broker that name sits on our subclass.
    """
    for ours, theirs in (
        (WakeableRedisConsumer, _RedisConsumer),
        (PipelineRedisBroker, RedisBroker),
    ):
        for name, value in vars(ours).items():
            defined = inspect.isfunction(value) or isinstance(
                value, property | classmethod | staticmethod
            )
            if defined and name.startswith("_") and not name.startswith("__"):
                assert not hasattr(theirs, name), f"{ours.__name__}.{name} shadows Dramatiq's"


def test_the_exception_that_failed_a_message_is_where_current_exception_reads():
    message = MessageProxy(Message("payments", "actor", (), {}, {}))
    assert current_exception(message) is None
    failure = ActorNotFound("ghost")
    message.stuff_exception(failure)
    assert message._exception is failure and current_exception(message) is failure
    message.clear_exception()
    assert current_exception(message) is None
    # The worker stuffs it before the message reaches before_nack: for an unknown actor
    # in the consumer thread, for an actor that raised in the worker thread.
    unknown = inspect.getsource(dramatiq.worker._ConsumerThread.handle_message)
    assert re.search(
        r"except ActorNotFound as e:(.|\n)*stuff_exception\(e\)(.|\n)*"
        r"self\.post_process_message\(message\)",
        unknown,
    )
    raised = inspect.getsource(dramatiq.worker._WorkerThread.process_message)
    assert re.search(r"except BaseException as e:\n\s+message\.stuff_exception\(e\)", raised)
    assert raised.index("stuff_exception(e)") < raised.index("post_process_message(message)")


def private_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names used, names defined) that start with one underscore, in a module's tree."""
    used: set[str] = set()
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (defined if isinstance(node.ctx, ast.Store) else used).add(node.id)
        elif isinstance(node, ast.Attribute):
            (defined if isinstance(node.ctx, ast.Store) else used).add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.alias):
            used.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.add(node.value)  # getattr(x, "_name")

    def private(names: set[str]) -> set[str]:
        return {n for n in names if re.fullmatch(r"_[A-Za-z]\w*", n) and not n.endswith("__")}

    return private(used), private(defined)


def test_every_private_name_the_transport_uses_is_pinned_here():
    used: set[str] = set()
    defined: set[str] = set()
    for path in Path(pipeline.transport.__file__).parent.rglob("*.py"):
        module_used, module_defined = private_names(ast.parse(path.read_text()))
        used |= module_used
        defined |= module_defined
    assert used - defined == set(DRAMATIQ_PRIVATE_NAMES)
    tests = {name for name, value in globals().items() if name.startswith("test_")}
    assert set(DRAMATIQ_PRIVATE_NAMES.values()) <= tests


def test_the_private_rabbitmq_classes_still_have_what_the_subclass_uses():
    """The RabbitMQ broker subclasses Dramatiq's consumer and re-implements its ``__next__``
    and queue declarations (``pipeline/transport/amqp/broker.py``)."""
    from dramatiq.brokers.rabbitmq import RabbitmqBroker, _RabbitmqConsumer, _RabbitmqMessage

    from pipeline.transport.amqp.broker import PipelineRabbitmqBroker, PipelineRabbitmqConsumer

    assert issubclass(PipelineRabbitmqConsumer, _RabbitmqConsumer)
    assert list(inspect.signature(_RabbitmqConsumer).parameters) == [
        "broker",
        "queue_name",
        "prefetch",
        "timeout",
    ]
    assert list(inspect.signature(_RabbitmqMessage).parameters) == ["redelivered", "tag", "message"]
    assert "self._tag = tag" in inspect.getsource(_RabbitmqMessage.__init__)  # what ack reads
    for name in ("__init__", "__next__", "ack", "nack", "requeue", "close"):
        assert name in PipelineRabbitmqConsumer.__dict__, name  # none of Dramatiq's runs
    ensure = inspect.getsource(RabbitmqBroker._ensure_queue)
    for call in ("_declare_queue(", "_declare_dq_queue(", "_declare_xq_queue("):
        assert call in ensure, call
    for name in ("_declare_queue", "_declare_dq_queue", "_declare_xq_queue"):
        assert name in PipelineRabbitmqBroker.__dict__, name  # every declaration is ours
    worker = inspect.getsource(dramatiq.worker._ConsumerThread.handle_delayed_messages)
    assert "self.broker.enqueue(new_message)" in worker  # a due delayed message: our enqueue
    assert worker.index("self.broker.enqueue(") < worker.index("self.post_process_message(")


def test_a_consumer_thread_still_holds_delayed_messages_where_the_consumer_forgets_them():
    """After RabbitMQ closed a consumer's channel, the consumer (iterated by its
    ``ConsumerThread``) replaces that thread's ``delay_queue``, as Dramatiq's own run loop
    does on a connection error, and ``handle_delayed_messages`` reads it afresh."""
    thread = dramatiq.worker.ConsumerThread
    assert "self.delay_queue: PriorityQueue" in inspect.getsource(thread.__init__)
    run = inspect.getsource(thread.run)
    assert "for message in self.consumer:" in run  # __next__ runs on the consumer thread
    assert "self.delay_queue = PriorityQueue()" in run
    assert "iter_queue(self.delay_queue)" in inspect.getsource(thread.handle_delayed_messages)


def test_pikas_blocking_channel_still_has_the_channel_the_publisher_confirms_on():
    """The publisher confirms a batch in one round on the blocking channel's ``_impl``."""
    import pika.adapters.blocking_connection as blocking
    import pika.channel

    init = inspect.getsource(blocking.BlockingChannel.__init__)
    assert "self._impl = channel_impl" in init
    assert list(inspect.signature(pika.channel.Channel.confirm_delivery).parameters) == [
        "self",
        "ack_nack_callback",
        "callback",
    ]
    publish = list(inspect.signature(pika.channel.Channel.basic_publish).parameters)
    assert publish[:6] == ["self", "exchange", "routing_key", "body", "properties", "mandatory"]


def test_dramatiq_logs_a_failed_close_with_the_words_the_rabbitmq_filter_quietens():
    """``QuietCloseFailures`` recognises Dramatiq's failed-close lines by their first words;
    another wording would bring the tracebacks back at every RabbitMQ outage."""
    import dramatiq.brokers.rabbitmq

    from pipeline.transport.amqp.broker import CLOSING_FAILED, QuietCloseFailures

    source = inspect.getsource(dramatiq.brokers.rabbitmq)
    assert f'"{CLOSING_FAILED} Channel."' in source
    assert f'"{CLOSING_FAILED} Connection."' in source
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        record = logging.LogRecord(
            "dramatiq.broker.PipelineRabbitmqBroker", logging.ERROR, __file__, 1,
            f"{CLOSING_FAILED} Channel.", (), sys.exc_info(),
        )  # fmt: skip
    assert QuietCloseFailures().filter(record) is False  # the logger is not at DEBUG
    assert record.exc_info is None and record.levelno == logging.DEBUG
    assert record.getMessage() == (
        f"{CLOSING_FAILED} Channel. ConnectionResetError: [Errno 104] Connection reset by peer"
    )
