"""The Dramatiq message JSON the publisher writes without building a ``Message``.

The relay enqueues with Dramatiq's ``dispatch`` script directly, so it writes the body
Dramatiq's ``RedisBroker.enqueue`` would: ``Message.encode()`` of a message whose one
argument is the list of envelopes and whose options carry the Redis message id.
Built from string pieces, with the envelopes spliced in as they were encoded (once per
event, cached across deliveries): a dict and ``json.dumps`` per message cost the hot path
more. ``tests/unit/test_dramatiq_contract.py`` checks that Dramatiq decodes it to the
message meant and encodes that message to the same bytes.
"""

from __future__ import annotations

REDIS_MESSAGE_ID = "redis_message_id"
"""The option under which Dramatiq's Redis broker finds a message's id in its queue."""


def message_json(
    queue_name: str,
    actor_name: str,
    envelopes: str,
    redis_message_id: str,
    message_id: str,
    timestamp_ms: int,
) -> str:
    """The message calling ``actor_name`` with one argument, the JSON array ``[envelopes]``.

    ``envelopes`` is the comma-joined JSON of the envelopes; names and ids are plain
    (validated queue and actor names, UUIDs) and need no escaping.
    """
    return (
        f'{{"queue_name":"{queue_name}","actor_name":"{actor_name}",'
        f'"args":[[{envelopes}]],"kwargs":{{}},'
        f'"options":{{"{REDIS_MESSAGE_ID}":"{redis_message_id}"}},'
        f'"message_id":"{message_id}","message_timestamp":{timestamp_ms}}}'
    )
