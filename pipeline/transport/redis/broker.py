"""The Dramatiq broker on Redis, built from settings.

It builds on Dramatiq internals (the private ``_RedisConsumer``, the arguments of the
``dispatch`` Lua script and its key layout), so Dramatiq is pinned to one minor series
in pyproject.toml and ``tests/unit/test_dramatiq_contract.py`` fails when they change.

``PipelineRedisBroker`` changes one thing in Dramatiq's Redis consumer: an idle
consumer blocks on a per-queue wake-up list instead of sleeping up to
``worker_timeout``, so an idle pipeline delivers at once without polling Redis hard.
Every enqueue pushes a wake-up (the relay's publisher with each batch, this broker
for Dramatiq's own enqueues). The wait and the fetch after it travel in one pipeline:
Redis runs the fetch the moment the wait ends, so a wake-up costs no second round
trip, and a wait that timed out still fetches (messages requeued by Dramatiq's
maintenance carry no wake-up). The process's heartbeat rides on one fetch a second (a
call of Dramatiq's dispatch script), not on every consumer thread's. One wake-up wakes one
consumer; one whose fetch came back full passes a wake-up on, so others join in on a
backlog.

A fetched id whose body is gone is told apart before anything is dead-lettered. Each
acknowledgement (and rejection) first records its id in a bounded sorted set of the
queue's finished ids, so a leftover id of a finished message (Dramatiq's maintenance
requeued a slow consumer's un-acked ids, or a replay pushed it again) is an absorbed
duplicate, counted and dropped. An id shaped like Dramatiq's (a UUID) that is not
among them had its body removed before it ran (Redis evicted it under ``allkeys-lru``):
a lost delivery, counted and dropped, which the relay's delivery ledger sends again.
Both go to :attr:`PipelineRedisBroker.missing_body_sink`. Only undecodable bodies, and
bare values pushed on a queue by something other than a Dramatiq client, are handed to
:attr:`PipelineRedisBroker.undecodable_sink` (a dead letter) and removed, instead of
being stuck in the consumer's un-acked set.

Every message is settled (acknowledged, rejected, requeued) under the Redis id it was
fetched by, never under the ``redis_message_id`` its body names: Dramatiq's fetch returns
bodies only, so the broker fetches with a script of its own that returns each id with its
body (:meth:`PipelineRedisBroker.fetch`). A body naming another id than the one it is
stored under, or another queue than the one it is on, was not written by a Dramatiq
client and is dead-lettered like one without the option. While Redis is down a worker
process waits with growing pauses, logging one line per pause (:class:`BrokerOutage`).

A Redis that drops its connections for a moment (a restart, a failover) is ridden out
where Dramatiq would wait seconds or lose a consumer: an acknowledgement, an enqueue (a
retry, a deferred event, a delayed message coming due) and a requeue are tried again for
up to ``BLIP_SECONDS`` (:func:`through_blip`) before they fail. Dramatiq's worker thread
waits 5 s before it tries a failed acknowledgement again, and its consumer thread restarts
3 s after an enqueue of a due delayed message failed; a requeue that still fails then
raises Dramatiq's ``ConnectionClosed``, which that consumer thread survives, where a
Redis error would end the thread and leave the queue's delayed messages unmoved for the
life of the worker process.
"""

from __future__ import annotations

import heapq
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.common import compute_backoff, current_millis
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message

from pipeline.config import Settings
from pipeline.transport.base import MissingBodySink, UndecodableSink, worker_middleware
from pipeline.transport.outage import BrokerOutage
from pipeline.transport.redis.client import redis_client
from pipeline.transport.redis.encoding import REDIS_MESSAGE_ID
from pipeline.transport.redis.keys import (
    acks_key,
    done_key,
    heartbeats_key,
    messages_key,
    queue_key,
    wake_key,
)

log = logging.getLogger("pipeline.transport.broker")


def _log_undecodable(queue_name: str, data: bytes, reason: str) -> None:
    log.error("dropped undecodable message", extra={"queue": queue_name, "reason": reason})


def _log_missing_bodies(queue_name: str, duplicates: int, lost: int) -> None:
    log.warning(
        "dropped message ids without a body",
        extra={"queue": queue_name, "duplicates": duplicates, "lost": lost},
    )


ORPHAN_LOOK_SECONDS = 15.0
"""How often a consumer looks for un-acked ids of its own that it no longer holds."""
HEARTBEAT_EVERY_SECONDS = 1.0
"""How often a worker process's fetches refresh its heartbeat, at most."""

T = TypeVar("T")
BLIP_SECONDS = 2.0
"""How long an acknowledgement, enqueue or requeue is tried again through connection errors."""
BLIP_FIRST_PAUSE = 0.05
BLIP_MAX_PAUSE = 0.5


def through_blip(call: Callable[[], T]) -> T:
    """``call()``, tried again through connection errors for up to ``BLIP_SECONDS``
    (pauses from ``BLIP_FIRST_PAUSE`` doubling to ``BLIP_MAX_PAUSE``), then the last error.

    Only for calls that may run twice: a settlement (acknowledging an id twice is once) or
    an enqueue (a second copy, if the first reached Redis before its reply was lost, is a
    duplicate the inbox absorbs).
    """
    deadline = time.monotonic() + BLIP_SECONDS
    pause = BLIP_FIRST_PAUSE
    while True:
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, BLIP_MAX_PAUSE)


# Finished message ids are remembered per queue, the last PIPELINE_FINISHED_IDS_KEPT of
# them (50,000 by default: about 6 MB of Redis per queue when full): a leftover id older
# than that many acknowledgements counts as lost, not as a duplicate, which costs one
# needless look by the delivery ledger, never a second run.

# KEYS[1] a consumer's un-acked set, KEYS[2] the queue's message bodies, KEYS[3] the queue's
# finished ids. Removes the members that have no body and returns them, each followed by 1
# if it is a finished message's id (a duplicate) and 0 if not. Atomic, so a message being
# acked (set member and body removed together) is never mistaken for one; an ack records
# its id as finished before it removes the body.
_TAKE_BARE_VALUES = """
local bare = {}
for _, id in ipairs(redis.call('smembers', KEYS[1])) do
    if redis.call('hexists', KEYS[2], id) == 0 then
        redis.call('srem', KEYS[1], id)
        table.insert(bare, id)
        table.insert(bare, redis.call('zscore', KEYS[3], id) and 1 or 0)
    end
end
return bare
"""
# KEYS[1] the queue, KEYS[2] this consumer's un-acked set, KEYS[3] the queue's bodies;
# ARGV[1] how many to fetch. Dramatiq's fetch (dispatch.lua: pop ids off the head of the
# queue, record each in the un-acked set, read their bodies), returning each id followed
# by its body (nil when there is none) instead of the bodies alone. The heartbeat and
# maintenance that Dramatiq's fetch does ride on a call of its script that fetches none,
# made once a second a process (PipelineRedisBroker._fetch_heartbeat_due).
_FETCH_WITH_IDS = """
local fetched = {}
for _ = 1, tonumber(ARGV[1]) do
    local id = redis.call('lpop', KEYS[1])
    if not id then
        break
    end
    redis.call('sadd', KEYS[2], id)
    table.insert(fetched, id)
    table.insert(fetched, redis.call('hget', KEYS[3], id))
end
return fetched
"""
UNACKNOWLEDGEABLE_REASON = (
    f"a message without the {REDIS_MESSAGE_ID!r} option Dramatiq acknowledges it by "
    "(not enqueued by a Dramatiq client)"
)


def is_message_id(value: bytes) -> bool:
    """Whether ``value`` is shaped like the ids Dramatiq clients give messages (a UUID)."""
    try:
        text = value.decode("ascii")
        return str(uuid.UUID(text)) == text
    except (UnicodeDecodeError, ValueError):
        return False


MISNAMED_REASON = (
    f"a message whose {REDIS_MESSAGE_ID!r} option names another id than the one it is "
    "stored under (not enqueued by a Dramatiq client)"
)

MISQUEUED_REASON = (
    "a message whose queue_name names another queue than the one it is on "
    "(not enqueued by a Dramatiq client)"
)

BARE_VALUE_REASON = (
    "a bare value on the queue, not a Dramatiq message (nothing was enqueued under it)"
)


def _malformed(message: Message[Any], redis_id: str, queue_name: str) -> str | None:
    """Why a decoded message fetched under ``redis_id`` from ``queue_name`` must not run,
    or None if it can."""
    if not isinstance(message.options, dict) or not isinstance(
        message.options.get(REDIS_MESSAGE_ID), str
    ):
        return UNACKNOWLEDGEABLE_REASON
    if message.options[REDIS_MESSAGE_ID] != redis_id:
        return MISNAMED_REASON
    if not isinstance(message.args, list | tuple) or not isinstance(message.kwargs, dict):
        return "undecodable message: its args are not a list or its kwargs not an object"
    if not all(isinstance(name, str) for name in (message.queue_name, message.actor_name)):
        return "undecodable message: its queue or actor name is not a string"
    if message.queue_name != queue_name:
        # Dramatiq's worker settles a message through the consumer of the queue it names:
        # another queue's consumer would leave it behind here, to come back.
        return MISQUEUED_REASON
    return None


class FetchedMessage(MessageProxy):
    """A message as the consumer fetched it, with the Redis id it is stored under: the id
    it is acknowledged, rejected and requeued by (never the one its body names)."""

    def __init__(self, message: Message[Any], redis_id: str) -> None:
        super().__init__(message)
        self.redis_id = redis_id


def _fetched_id(message: MessageProxy) -> str:
    if not isinstance(message, FetchedMessage):  # settling by the body's id is what it avoids
        raise TypeError(f"not a message this consumer fetched: {type(message).__name__}")
    return message.redis_id


class WakeableRedisConsumer(_RedisConsumer):
    """Dramatiq's Redis consumer, waking on a wake-up list instead of sleeping blind.

    While Redis is down it waits out the broker's :class:`BrokerOutage` (one log line per
    backoff step for the whole process) instead of raising to Dramatiq, whose consumer
    threads would each log a critical error and restart every three seconds.

    A fetch that fails may still have run on the server (the reply was lost, a socket
    timed out): its ids then sit in this process's un-acked set with nobody holding them,
    and, this worker being alive, Dramatiq would never put them back. So after a failed
    fetch the next fetch first requeues every un-acked id of this consumer that it did not
    hand out (:meth:`_requeue_orphans`). It also looks every ``ORPHAN_LOOK_SECONDS`` while
    fetching, whatever left an id there unheld (a settlement that failed for good, a
    consumer restarted, a worker paused past the heartbeat timeout whose un-acked set
    another worker's maintenance emptied meanwhile): the delivery ledger counts a live
    worker's un-acked messages in flight and would never send them again.

    An idle wait lasts ``worker_timeout`` (at most a tenth of the heartbeat timeout: a
    heartbeat that rides on the fetch is stamped before the wait), but never past the
    moment a delayed message this consumer handed out comes due: Dramatiq's consumer
    thread holds such a message (a retry waiting out its backoff) and enqueues it only
    between two of this consumer's returns, so a long idle wait would delay retries by up
    to the wait. Bounded by the due times, the wait can be long (cheap when idle) and a
    retry still runs on time.

    ``message_cache`` holds (Redis id, body) pairs, and ``queued_message_ids`` the Redis
    ids of the messages handed to worker threads and not yet settled.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._orphans_possible = False  # a fetch failed since the last look at the un-acked set
        self._next_orphan_look = time.monotonic() + ORPHAN_LOOK_SECONDS
        self._due_times: list[int] = []  # heap: epoch ms at which a handed-out delay is due

    def __next__(self) -> Any:
        outage: BrokerOutage = self.broker.outage
        pause = outage.pause()
        if pause:  # short naps: the consumer thread must see a stop request promptly
            time.sleep(min(pause, self.timeout / 1000))
            return None
        try:
            while True:
                try:
                    redis_id, data = self.message_cache.pop(0)
                except IndexError:
                    fetched = self._fetch()
                    outage.succeeded()
                    if not fetched:
                        return None
                    continue
                self.misses = 0
                try:
                    message = Message.decode(data)
                except (DecodeError, UnicodeDecodeError, TypeError, KeyError) as exc:
                    self._discard_undecodable(redis_id, data, f"undecodable message: {exc}")
                    continue
                malformed = _malformed(message, redis_id, self.queue_name)
                if malformed is not None:
                    self._discard_undecodable(redis_id, data, malformed)
                    continue
                self.queued_message_ids.add(redis_id)
                eta = message.options.get("eta")
                if isinstance(eta, int | float) and not isinstance(eta, bool):
                    heapq.heappush(self._due_times, int(eta))
                return FetchedMessage(message, redis_id)
        except redis.RedisError as exc:
            self._orphans_possible = True
            outage.failed(exc)
            return None

    def _requeue_orphans(self, after_failed_fetch: bool) -> None:
        """Put back on the queue the un-acked ids of this consumer that nobody holds."""
        broker = self.broker
        acks = acks_key(broker.namespace, broker.broker_id, self.queue_name)
        held = set(self.queued_message_ids)
        members = broker.client.smembers(acks)
        held |= self.queued_message_ids  # a message handed out meanwhile is held, not orphaned
        orphans = [_text(member) for member in members if _text(member) not in held]
        if orphans:
            broker.do_requeue(self.queue_name, *orphans)
            broker.wake(self.queue_name)
            log.warning(
                "requeued messages a failed fetch had taken but never delivered"
                if after_failed_fetch
                else "requeued un-acked messages this consumer no longer held",
                extra={"queue": self.queue_name, "count": len(orphans)},
            )

    _drained = False  # the last fetch got fewer messages than it asked for: the queue is empty

    def _fetch(self) -> bool:
        now = time.monotonic()
        if self._orphans_possible or now >= self._next_orphan_look:
            # only here, with the cache empty: every id this consumer holds is handed out
            self._requeue_orphans(after_failed_fetch=self._orphans_possible)
            self._orphans_possible = False
            self._next_orphan_look = now + ORPHAN_LOOK_SECONDS
        wanted = self.prefetch - self.outstanding_message_count
        if wanted <= 0:  # enough in hand: back off
            self.misses, backoff_ms = compute_backoff(self.misses, max_backoff=self.timeout)
            time.sleep(backoff_ms / 1000)
            return False
        wait_ms = self._idle_wait_ms() if self._drained else 0
        if wait_ms:  # anything enqueued since the last fetch pushed a wake-up after it
            messages = self.broker.wait_and_fetch(self.queue_name, wanted, wait_ms)
        else:
            messages = self.broker.fetch(self.queue_name, wanted)
        if any(data is None for _, data in messages):  # an id without a body
            self._sort_out_bare_values()
            messages = [(redis_id, data) for redis_id, data in messages if data is not None]
        self.message_cache = messages
        # A full fetch, or one cut at Dramatiq's unpack limit, may have left a
        # backlog: fetch again without waiting, and wake another consumer for it.
        self._drained = len(messages) < min(wanted, self.broker._max_unpack_size())
        if not self._drained:
            self.broker.wake(self.queue_name)
        return bool(messages)

    def _idle_wait_ms(self) -> int:
        """How long an idle fetch may wait: ``worker_timeout``, or until the earliest
        handed-out delayed message is due; 0 when one is due already (the consumer thread
        enqueues it as soon as this fetch returns)."""
        due_times, now = self._due_times, current_millis()
        if due_times and due_times[0] <= now:
            while due_times and due_times[0] <= now:
                heapq.heappop(due_times)
            return 0
        # A heartbeat riding on this fetch is stamped before the wait: keep it young.
        longest = min(self.timeout, self.broker.heartbeat_every * 1000)
        if not due_times:
            return int(longest)
        return int(min(longest, due_times[0] - now))

    def ack(self, message: MessageProxy) -> None:
        self._finish("ack", message)

    def nack(self, message: MessageProxy) -> None:
        self._finish("nack", message)

    def _finish(self, command: str, message: MessageProxy) -> None:
        """Dramatiq's ack or nack, by the id the message was fetched under.

        A settlement that Redis did not answer (a lost connection, a read that timed out,
        a master demoted to a read-only replica mid-failover) is raised as Dramatiq's
        connection error, on which Dramatiq's worker tries it again until Redis answers;
        the id stays held meanwhile. Any other failure leaves the id in this consumer's
        un-acked set with nobody holding it, so the next fetch puts it back on the queue
        (:meth:`_requeue_orphans`) rather than leaving it there for the life of this
        process, where the delivery ledger would take it for in flight and hold back the
        queue's re-sends; the inbox absorbs the second delivery.
        """
        redis_id = _fetched_id(message)
        try:
            through_blip(lambda: self._settle(command, redis_id))
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError) as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        except BaseException:
            self.queued_message_ids.discard(redis_id)
            self._orphans_possible = True
            raise
        self.queued_message_ids.discard(redis_id)

    def _settle(self, command: str, redis_id: str) -> None:
        """Dramatiq's ack or nack of ``redis_id``, after recording it among the queue's
        finished ids.

        One round trip: the record (and the trim of the set to the broker's
        ``finished_ids_kept``) and Dramatiq's dispatch script travel in one pipeline, the
        record first, so an id is known finished before its body goes.
        """
        broker = self.broker
        key = done_key(broker.namespace, self.queue_name)
        pipe = broker.client.pipeline(transaction=False)
        pipe.zadd(key, {redis_id: current_millis()})
        pipe.zremrangebyrank(key, 0, -broker.finished_ids_kept - 1)
        broker.push_dispatch(pipe, command, self.queue_name, redis_id)
        results = pipe.execute(raise_on_error=False)
        if isinstance(results[-1], redis.exceptions.NoScriptError):
            getattr(broker, f"do_{command}")(self.queue_name, redis_id)  # loads the script
        elif isinstance(results[-1], Exception):
            raise results[-1]

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Dramatiq's requeue (a stopping worker's unprocessed messages, or a consumer
        thread's delayed ones when it restarts) by the ids they were fetched under, then a
        wake-up.

        A Redis that stays unreachable past ``BLIP_SECONDS`` raises ``ConnectionClosed``:
        Dramatiq's consumer thread survives that and starts again, where a Redis error
        would end it. The ids stay in this consumer's un-acked set.
        """
        redis_ids = [_fetched_id(message) for message in messages]
        if redis_ids:
            try:
                through_blip(lambda: self.broker.do_requeue(self.queue_name, *redis_ids))
            except redis.RedisError as exc:
                raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
            self.broker.wake(self.queue_name)

    def _sort_out_bare_values(self) -> None:
        """Take ids without a message body out of the un-acked set and sort them out.

        A finished message's id is a duplicate and an unfinished UUID a lost delivery:
        both are counted by the broker's ``missing_body_sink`` and dropped (the ledger
        sends a lost delivery again). Anything else is a bare value something pushed on
        the queue (not a Dramatiq message): its raw value goes to the undecodable sink
        (a consume-stage dead letter; the sink logs one line, without the value). If the
        sink fails, the value goes back to the un-acked set (requeued when this worker
        stops) rather than being lost.
        """
        broker = self.broker
        acks = acks_key(broker.namespace, broker.broker_id, self.queue_name)
        bodies = messages_key(broker.namespace, self.queue_name)
        done = done_key(broker.namespace, self.queue_name)
        found = broker.take_bare_values(keys=[acks, bodies, done])
        duplicates = lost = 0
        for value, finished in zip(found[::2], found[1::2], strict=True):
            if int(finished):
                duplicates += 1
            elif is_message_id(value):
                lost += 1
            else:
                self._dead_letter_bare_value(acks, value)
        if duplicates or lost:
            broker.missing_body_sink(self.queue_name, duplicates, lost)

    def _dead_letter_bare_value(self, acks: str, value: bytes) -> None:
        broker = self.broker
        try:
            broker.undecodable_sink(self.queue_name, value, BARE_VALUE_REASON)
        except Exception as exc:
            broker.client.sadd(acks, value)
            log.error(
                "could not dead-letter a value that is not a Dramatiq message; "
                "it returns to the queue when this worker stops",
                extra={"queue": self.queue_name, "error_class": type(exc).__name__},
            )

    def _discard_undecodable(self, redis_id: str, data: bytes, reason: str) -> None:
        """Hand the raw bytes to the sink, then acknowledge the message by the id it was
        fetched under (it can never run), recording that id among the finished ones.

        If the sink fails, the message stays in the un-acked set (requeued when this worker
        stops) rather than being lost; it is removed only once it has been recorded. (If
        the acknowledgement fails after the record, the message comes back and the sink
        finds it recorded already.)
        """
        try:
            self.broker.undecodable_sink(self.queue_name, data, reason)
        except Exception as exc:
            log.error(
                "could not dead-letter an unreadable message; "
                "it returns to the queue when this worker stops",
                extra={"queue": self.queue_name, "error_class": type(exc).__name__},
            )
            return
        self._settle("ack", redis_id)


class PipelineRedisBroker(RedisBroker):
    undecodable_sink: UndecodableSink = staticmethod(_log_undecodable)
    missing_body_sink: MissingBodySink = staticmethod(_log_missing_bodies)

    def __init__(
        self,
        *args: Any,
        outage_backoff_max: float = 10.0,
        finished_ids_kept: int = 50_000,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.finished_ids_kept = finished_ids_kept
        self.outage = BrokerOutage("Redis", cap=outage_backoff_max)
        self.take_bare_values = self.client.register_script(_TAKE_BARE_VALUES)
        self.fetch_with_ids = self.client.register_script(_FETCH_WITH_IDS)
        # The fetches' heartbeat: one dispatch call a process per interval (see _fetch),
        # which also bounds an idle consumer's wait (WakeableRedisConsumer._idle_wait_ms).
        self.heartbeat_every = min(HEARTBEAT_EVERY_SECONDS, self.heartbeat_timeout / 10_000)
        self._last_fetch_heartbeat = float("-inf")
        self._fetches_since_heartbeat = 0

    @property
    def consumer_class(self) -> type[WakeableRedisConsumer]:
        return WakeableRedisConsumer

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's enqueue (actor sends, re-sends, due delayed messages), then a wake-up;
        tried again through a connection blip (:func:`through_blip`)."""
        enqueue = super().enqueue
        enqueued: Message[Any] = through_blip(lambda: enqueue(message, delay=delay))
        self.wake(enqueued.queue_name)
        return enqueued

    def wake(self, queue_name: str) -> None:
        """Leave one wake-up on the queue's list (a list of at most one: wake-ups fold).

        Best effort: the message is already queued, and an idle consumer's next wait ends
        with a fetch within ``worker_timeout`` even if this fails (raising would make a
        caller send it again).
        """
        try:
            pipe = self.client.pipeline(transaction=False)
            self.push_wake(pipe, queue_name)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning(
                "could not push a wake-up; consumers find the message after their next wait",
                extra={"queue": queue_name, "error_class": type(exc).__name__},
            )

    def oldest_waiting(self, queue_name: str) -> datetime | None:
        """When the oldest message still in flight on the queue was enqueued: the one at
        the head of the queue, or one a live consumer fetched and has not acknowledged
        yet (prefetched, or running); None when none is.

        Dramatiq appends to the queue's list and fetches from its head, so the head is
        the oldest message not yet fetched. A consumer's fetched messages sit in its
        un-acked set while its heartbeat is younger than the heartbeat timeout (after
        that Dramatiq puts them back on the queue). Unreadable messages count as none:
        whatever they are, they carry no delivery.
        """
        namespace = self.namespace
        pipe = self.client.pipeline(transaction=False)
        pipe.lindex(queue_key(namespace, queue_name), 0)
        pipe.zrangebyscore(
            heartbeats_key(namespace), current_millis() - self.heartbeat_timeout, "+inf"
        )
        head, live = pipe.execute()
        ids: list[Any] = [] if head is None else [head]
        if live:
            pipe = self.client.pipeline(transaction=False)
            for broker_id in live:
                pipe.smembers(acks_key(namespace, _text(broker_id), queue_name))
            for members in pipe.execute():
                ids.extend(members)
        if not ids:
            return None
        bodies = self.client.hmget(messages_key(namespace, queue_name), ids)
        stamps = [stamp for stamp in map(_message_millis, bodies) if stamp is not None]
        return datetime.fromtimestamp(min(stamps) / 1000, tz=UTC) if stamps else None

    def push_wake(self, pipe: Any, queue_name: str) -> None:
        """Add to ``pipe`` the commands that leave one wake-up on the queue's list."""
        key = wake_key(self.namespace, queue_name)
        pipe.lpush(key, "1")
        pipe.ltrim(key, 0, 0)

    def push_dispatch(
        self,
        pipe: Any,
        command: str,
        queue_name: str,
        *args: object,
        maintenance: bool = True,
        chances: int = 1,
    ) -> None:
        """Add to ``pipe`` a call of Dramatiq's dispatch script, as its ``do_<command>`` makes.

        ``EVALSHA`` directly, without redis-py's ``SCRIPT EXISTS`` round trip: a caller
        whose server lost its scripts gets ``NoScriptError`` and loads them.
        ``maintenance=False`` never asks the script for maintenance on this call;
        ``chances`` gives it the maintenance chances of that many calls (of calls it
        stands for and that were not made).
        """
        do_maintenance = (
            int(any(self._should_do_maintenance(command) for _ in range(chances)))
            if maintenance
            else 0
        )
        pipe.evalsha(
            self.scripts["dispatch"].sha,
            1,
            self.namespace,
            command,
            current_millis(),
            queue_name,
            self.broker_id,
            self.heartbeat_timeout,
            self.dead_message_ttl,
            do_maintenance,
            self._max_unpack_size(),  # type: ignore[no-untyped-call]
            *args,
        )

    def fetch(self, queue_name: str, wanted: int) -> list[tuple[str, bytes | None]]:
        """Fetch up to ``wanted`` messages (at most Dramatiq's unpack limit) as (Redis id,
        body) pairs, the body None where the id has none, as Dramatiq's fetch does: the ids
        move from the queue to this worker's un-acked set.

        One round trip: the fetch script and, when the process's heartbeat is due
        (:meth:`_fetch_heartbeat_due`), a call of Dramatiq's dispatch script that fetches
        none (the heartbeat, and maintenance by chance), in one pipeline.
        """
        return self._fetch(queue_name, wanted, None)

    def wait_and_fetch(
        self, queue_name: str, wanted: int, timeout_ms: int
    ) -> list[tuple[str, bytes | None]]:
        """Wait up to ``timeout_ms`` for a wake-up, then :meth:`fetch`.

        One round trip: the wait goes in the fetch's pipeline, and Redis runs the fetch as
        soon as the wait ends, woken or not. A heartbeat's timestamp is taken before the
        wait, at most ``timeout_ms`` early, far inside the heartbeat timeout.
        """
        return self._fetch(queue_name, wanted, timeout_ms)

    def _fetch(
        self, queue_name: str, wanted: int, timeout_ms: int | None
    ) -> list[tuple[str, bytes | None]]:
        namespace = self.namespace
        pipe = self.client.pipeline(transaction=False)
        if timeout_ms is not None:
            pipe.blpop([wake_key(namespace, queue_name)], max(timeout_ms / 1000, 0.01))
        heartbeat = self._fetch_heartbeat_due()
        if heartbeat:
            chances, self._fetches_since_heartbeat = self._fetches_since_heartbeat, 0
            self.push_dispatch(pipe, "fetch", queue_name, 0, chances=chances)
        pipe.evalsha(
            self.fetch_with_ids.sha,
            3,
            queue_key(namespace, queue_name),
            acks_key(namespace, self.broker_id, queue_name),
            messages_key(namespace, queue_name),
            min(wanted, self._max_unpack_size()),  # type: ignore[no-untyped-call]
        )
        # Replies checked one by one: a failed wait is only a missed hint, but a fetch that
        # succeeded holds messages already moved to this worker's un-acked set.
        replies = pipe.execute(raise_on_error=False)
        fetched, dispatched = replies[-1], replies[-2] if heartbeat else None
        lost_scripts = redis.exceptions.NoScriptError
        if isinstance(dispatched, lost_scripts) or isinstance(fetched, lost_scripts):
            self.client.script_load(self.scripts["dispatch"].script)  # Redis restarted, or
            self.client.script_load(_FETCH_WITH_IDS)  # SCRIPT FLUSH: load them again
            if isinstance(fetched, lost_scripts):
                return self._fetch(queue_name, wanted, None)
        elif isinstance(dispatched, Exception):
            raise dispatched
        if isinstance(fetched, Exception):
            raise fetched
        return [(_text(i), body) for i, body in zip(fetched[::2], fetched[1::2], strict=True)]

    def _fetch_heartbeat_due(self) -> bool:
        """Whether this fetch carries the process's heartbeat (Dramatiq's dispatch call,
        which fetches nothing here). Every consumer thread fetches at least once per idle
        wait, and each call of the script costs Redis a script run and this process a
        reply to parse, so one a process per ``heartbeat_every`` is enough: a tenth of
        the heartbeat timeout at most, and acknowledgements beat too. The fetches in
        between lend it their maintenance chances, so Dramatiq's maintenance (requeueing
        a dead worker's messages) runs as often as before.
        """
        self._fetches_since_heartbeat += 1
        now = time.monotonic()
        if now - self._last_fetch_heartbeat < self.heartbeat_every:
            return False
        self._last_fetch_heartbeat = now
        return True


def make_broker(
    settings: Settings, middleware: list[Any] | None = None, *, timeout: float | None = None
) -> PipelineRedisBroker:
    """A broker for the configured Redis (``redis://``, ``rediss://`` TLS, ``unix://``, or
    ``redis+sentinel://``: see :mod:`.client`).

    Dramatiq's Retries middleware sends a message whose actor raised back to the queue
    with exponential backoff (without it, Dramatiq 2 acknowledges the message and it is
    gone). Handler errors never reach it — the inbox retries those with its own
    bookkeeping (attempt history, dead letters in Postgres) — so what it retries is an
    infrastructure failure: the database or Redis went away mid-message. Each actor
    sets its own limits (``max_retries``, ``min_backoff``, ``max_backoff``).

    ``timeout`` bounds every Redis call (connect and reply) of the broker's client; None
    (workers, relays) blocks as long as a call takes.
    """
    stack = middleware if middleware is not None else worker_middleware()
    client = redis_client(settings.require_redis_url(), timeout)
    return PipelineRedisBroker(
        namespace=settings.redis_namespace,
        middleware=stack,
        heartbeat_timeout=settings.broker_heartbeat_timeout_ms,
        maintenance_chance=settings.broker_maintenance_chance,
        outage_backoff_max=settings.reconnect_backoff_max,
        finished_ids_kept=settings.finished_ids_kept,
        client=client,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _message_millis(body: bytes | None) -> float | None:
    """A message body's enqueue time in milliseconds, or None when it has none readable."""
    try:
        millis = json.loads(body)["message_timestamp"] if body is not None else None
    except (ValueError, TypeError, KeyError):
        return None
    return float(millis) if isinstance(millis, int | float) else None
