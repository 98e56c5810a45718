"""The Redis key layout: Dramatiq's (pinned by ``tests/unit/test_dramatiq_contract.py``)
and the pipeline's own keys beside it, all under ``<namespace>:``.

Dramatiq keeps a queue as a list of message ids (``<ns>:<queue>``), their bodies in a hash
(``<ns>:<queue>.msgs``), delayed messages on a second queue (``<queue>.DQ``, its own list
and hash) and rejected ones in a sorted set (``<ns>:<queue>.XQ``, bodies in its hash). A
consumer's fetched, un-acked ids sit in ``<ns>:__acks__.<broker id>.<queue>``. Only this
package spells these names.
"""

from __future__ import annotations

from dramatiq.common import dq_name, xq_name

MESSAGES_SUFFIX = ".msgs"


def queue_key(namespace: str, queue_name: str) -> str:
    """The list of message ids waiting on a queue, oldest at the head."""
    return f"{namespace}:{queue_name}"


def messages_key(namespace: str, queue_name: str) -> str:
    """The hash of a queue's message bodies, by Redis message id."""
    return f"{namespace}:{queue_name}{MESSAGES_SUFFIX}"


def delay_queue_key(namespace: str, queue_name: str) -> str:
    """The list of a queue's delayed messages that are due or waiting to be."""
    return queue_key(namespace, dq_name(queue_name))


def dead_set_key(namespace: str, queue_name: str) -> str:
    """The sorted set of a queue's rejected messages (Dramatiq's dead-letter set)."""
    return queue_key(namespace, xq_name(queue_name))


def acks_key(namespace: str, broker_id: str, queue_name: str) -> str:
    """The set of a consumer's fetched, un-acked message ids, as Dramatiq's dispatch script
    names it (``queue_acks`` in ``dramatiq/brokers/redis/dispatch.lua``; pinned, tested)."""
    return f"{namespace}:__acks__.{broker_id}.{queue_name}"


def heartbeats_key(namespace: str) -> str:
    """The sorted set of consumers' last heartbeats (broker id -> milliseconds), as
    Dramatiq's dispatch script names it (``heartbeats`` in ``dispatch.lua``)."""
    return f"{namespace}:__heartbeats__"


def wake_key(namespace: str, queue_name: str) -> str:
    """The pipeline's wake-up list of a queue (at most one element; idle consumers block on it)."""
    return f"{namespace}:pipeline-wake:{queue_name}"


def memory_key(namespace: str) -> str:
    """The pipeline's marker of what Redis remembers: set once, gone when Redis lost its data
    (restarted without persistence, flushed, failed over to an empty replica)."""
    return f"{namespace}:pipeline-memory"


def done_key(namespace: str, queue_name: str) -> str:
    """The pipeline's sorted set of a queue's recently acknowledged (or rejected) message
    ids, scored by when: an id found on the queue without a body is one of these when it
    is a leftover duplicate, not a lost message."""
    return f"{namespace}:pipeline-done:{queue_name}"


def queue_of_messages_key(namespace: str, key: str) -> str | None:
    """The queue whose messages a ``<ns>:<name>.msgs`` key holds, or None for Dramatiq's
    own bookkeeping keys (``__acks__``, ``__heartbeats__``) and foreign keys.

    The hashes of a queue's delayed and dead messages name the queue itself.
    """
    prefix = f"{namespace}:"
    if not key.startswith(prefix) or not key.endswith(MESSAGES_SUFFIX):
        return None
    name = key[len(prefix) : -len(MESSAGES_SUFFIX)]
    for suffix in (dq_name(""), xq_name("")):
        name = name.removesuffix(suffix)
    if not name or name.startswith("__"):
        return None
    return name
