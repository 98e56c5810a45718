"""Pure rules behind the worker's and relay's signals: which fetched ids are message ids,
what a heartbeat's age says about a relay, and a relay's wait that can tell a timeout
from a wake-up."""

from __future__ import annotations

import threading
import uuid

from pipeline.db.stores.relays import RelayInfo, relay_state
from pipeline.relay.relay import Waker
from pipeline.transport.redis.broker import is_message_id


def test_only_canonical_uuids_are_message_ids():
    assert is_message_id(str(uuid.uuid4()).encode())
    assert not is_message_id(b"garbage")
    assert not is_message_id(str(uuid.uuid4()).upper().encode())  # not as Dramatiq writes them
    assert not is_message_id(uuid.uuid4().hex.encode())
    assert not is_message_id(b"\xff\xfe")


def test_heartbeat_age_decides_alive_stale_and_gone():
    def state(age: float, busy: bool = False) -> str:
        return RelayInfo("r", "elsewhere", 1, busy, age).state

    assert state(0.5) == "idle" and state(9.9, busy=True) == "busy"
    assert state(10.0) == "stale" and state(59.0, busy=True) == "stale"
    assert state(60.0) == "gone" == relay_state(False, 3600.0)
    assert RelayInfo("r", "h", 1, False, 1.0).alive
    assert not RelayInfo("r", "h", 1, False, 11.0).alive


def test_the_waker_tells_a_timeout_from_a_wake_up():
    waker = Waker()
    assert waker.wait_for(0.01) is None
    assert waker.wait(0.01) == "poll"
    threading.Timer(0.01, waker, args=("notify",)).start()
    assert waker.wait_for(5) == "notify"
    waker("poll")  # an explicit poll is a wake-up, not a timeout
    assert waker.wait_for(0.01) == "poll"
