"""What transport/broker.py assumes of Dramatiq's internals, checked against the installed copy.

The broker calls Dramatiq's ``dispatch`` Lua script itself (``push_dispatch``), subclasses
the private ``_RedisConsumer`` and computes the un-acked set's key (``acks_key``). A
Dramatiq release that moves an argument, renames a key or an attribute fails here, before
it can misroute a message; Dramatiq is pinned to the minor series these tests passed on.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import re
from typing import Any

from dramatiq.brokers.redis import _RedisConsumer

from pipeline.config import Settings
from pipeline.transport.broker import PipelineRedisBroker, acks_key, make_broker

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


def test_the_acks_key_layout_is_the_one_acks_key_computes():
    statement(r'^local acks = namespace \.\. ":__acks__\." \.\. worker_id$')
    statement(r'^local queue_acks = acks \.\. "\." \.\. queue_name$')
    statement(r'^local queue_messages = queue_full_name \.\. "\.msgs"$')
    statement(r'^local queue_full_name = namespace \.\. ":" \.\. queue_name$')
    statement(r'redis\.call\("sadd", queue_acks, message_id\)')  # fetch records it there
    assert acks_key("ns", "worker-1", "payments") == "ns:__acks__.worker-1.payments"


def test_the_private_consumer_still_has_what_the_subclass_uses():
    consumer = _RedisConsumer(offline_broker(), "payments", 4, 100)
    for name in ("message_cache", "queued_message_ids", "misses", "prefetch", "timeout"):
        assert hasattr(consumer, name), name
    assert consumer.outstanding_message_count == 0
    broker = offline_broker()
    for name in ("_should_do_maintenance", "_max_unpack_size", "broker_id", "namespace"):
        assert hasattr(broker, name), name
    assert broker._should_do_maintenance("enqueue") in (0, 1)
