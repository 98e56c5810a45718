"""A broker the pipeline does not have to trust: real workers handle only signed messages.

With ``PIPELINE_MESSAGE_KEY`` set, the relay signs each envelope for its consumer and the
workers verify it. Whoever can write to Redis but lacks the key cannot make a handler run:
a made-up event, an altered payload, an envelope signed for another deployment or with
another key are dead-lettered as unauthentic, counted, and attributed to no event.

The refusals run through Dramatiq's worker in this process; the keys reaching a worker
process through its environment, and what the command says at start-up, through real ones.
"""

from __future__ import annotations

import copy
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from dramatiq.message import Message

from pipeline import NewEvent, Settings
from pipeline.envelope import OutboxEvent, encode_envelope
from pipeline.signing import EnvelopeSigner, MessageKeys, event_source
from pipeline.transport.factory import open_transport
from tests.integration.test_inbox import inbox_settings, publish_repeated, scalar
from tests.support import (
    process_metric,
    produce,
    queue_envelopes,
    running_app_worker,
    start_worker,
    stop_process,
    wait_until,
)

__all__ = ["inbox_settings"]  # the fixture, re-used from the inbox tests

APP = "tests.apps.inbox_app"
QUEUE, ACTOR, CONSUMER = "pipeline.ledger", "pipeline_inbox_ledger", "ledger"
KEY = "k" * 16 + "authentic-test-key-0123456789"
OTHER_KEY = "o" * 16 + "another-deployment-key-98765"


@pytest.fixture
def keyed(inbox_settings: Settings) -> Settings:
    return inbox_settings.replace(message_key=KEY)


def enqueue(settings: Settings, envelopes: list[Any]) -> None:
    """Put a message on the ledger queue as anyone with Redis access could (Dramatiq's API)."""
    transport = open_transport(settings, middleware=[])
    try:
        transport.broker.enqueue(
            Message(queue_name=QUEUE, actor_name=ACTOR, args=(envelopes,), kwargs={}, options={})
        )
    finally:
        transport.close()


def signed_envelope(event: OutboxEvent, key: str, deployment: str) -> dict[str, Any]:
    signer = EnvelopeSigner(MessageKeys(current=key.encode()), deployment)
    text = encode_envelope(event, deployment)
    signature = signer.signature(event, CONSUMER, signer.event_digest(event))
    parsed: dict[str, Any] = json.loads(signer.signed_text(text, signature))
    return parsed


def made_up_event(order_id: str, data: dict[str, Any] | None = None) -> OutboxEvent:
    """An ``entry.booked`` event of ``order_id`` (plus ``data``) as the relay reads it."""
    return OutboxEvent(
        uuid.uuid4(),
        1,
        None,
        order_id,
        order_id,
        "entry.booked",
        1,
        json.dumps({"order_id": order_id, **(data or {})}),
        "{}",
        0,
        datetime.now(UTC),
    )


def test_only_authentic_messages_run_and_the_others_are_dead_lettered_and_counted(
    engine, keyed: Settings
):
    produce(engine, [NewEvent("entry.booked", {"order_id": "genuine"}, aggregate_id="genuine")])
    publish_repeated(keyed, times=1)  # the relay's own publisher: signed for the ledger
    [genuine] = queue_envelopes(keyed, QUEUE)
    assert isinstance(genuine["pipelinesignature"], str)

    altered = copy.deepcopy(genuine)
    altered["data"]["order_id"] = "altered"  # same id and signature, another payload
    forged_unsigned = json.loads(encode_envelope(made_up_event("forged"), event_source(keyed)))
    forged_signed = dict(forged_unsigned, pipelinesignature="0" * 64)  # a guessed signature
    other_schema = signed_envelope(made_up_event("other-schema"), KEY, "/pipeline/elsewhere")
    other_key = signed_envelope(made_up_event("other-key"), OTHER_KEY, event_source(keyed))
    # Text Postgres cannot store as such: a NUL (escaped) and a lone surrogate (kept as text).
    unstorable = dict(forged_signed, data={"order_id": "unstorable", "nul": "a\x00b"})
    surrogate = dict(forged_signed, data={"order_id": "surrogate", "text": "\ud800"})
    envelopes = (altered, forged_unsigned, forged_signed, other_schema, other_key)
    for envelope in (*envelopes, unstorable, surrogate):
        enqueue(keyed, [envelope])

    def refused(reason: str) -> float:
        return process_metric(
            "pipeline_unauthentic_messages_total", consumer=CONSUMER, reason=reason
        )

    refused_before = {reason: refused(reason) for reason in ("mismatch", "unsigned")}
    with running_app_worker(keyed, APP):
        wait_until(
            lambda: (
                scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") >= 5
                and scalar(engine, "SELECT count(*) FROM effects") >= 1
            ),
            timeout=60,
        )
        wait_until(lambda: not queue_envelopes(keyed, QUEUE), timeout=30)

    effects = scalar(engine, "SELECT json_agg(order_id) FROM effects")
    assert effects == ["genuine"]  # the genuine event ran; none of the others did
    letters = scalar(
        engine,
        "SELECT json_agg(json_build_object('reason', reason, 'class', error_class,"
        " 'event', event_id, 'envelope', envelope, 'consumer', consumer, 'raw', raw_message)"
        " ORDER BY id) FROM pipeline.dead_letters",
    )
    assert len(letters) == 7
    [kept_as_text] = [letter for letter in letters if letter["envelope"] is None]
    assert '"surrogate"' in kept_as_text["raw"] and "\\ud800" in kept_as_text["raw"]
    [escaped] = [letter for letter in letters if "unstorable" in json.dumps(letter["envelope"])]
    assert escaped["envelope"]["data"]["nul"] == "a\\x00b"
    assert {letter["class"] for letter in letters} == {"UnauthenticMessage"}
    assert all(letter["reason"].startswith("unauthentic:") for letter in letters)
    assert all(letter["event"] is None for letter in letters)  # attributed to no event
    assert all(letter["consumer"] == CONSUMER for letter in letters)
    kept = sorted(
        letter["envelope"]["data"]["order_id"] for letter in letters if letter["envelope"]
    )
    assert kept == ["altered", "forged", "forged", "other-key", "other-schema", "unstorable"]
    unsigned = [letter for letter in letters if "no signature" in letter["reason"]]
    assert len(unsigned) == 1
    # The genuine event is processed, not dead, for all the altered copy claimed its id.
    assert scalar(engine, "SELECT count(*) FROM pipeline.inbox WHERE status = 'processed'") == 1

    assert refused("mismatch") - refused_before["mismatch"] == 6
    assert refused("unsigned") - refused_before["unsigned"] == 1


def test_keys_rotate_the_previous_key_still_verifies(engine, keyed: Settings, tmp_path):
    """Relay signing with the old key while workers already have the new one as current.

    A worker process, given both keys in its environment as an operator does; a worker
    with a key says nothing about a missing one."""
    produce(engine, [NewEvent("entry.booked", {"order_id": "rotated"})])
    publish_repeated(keyed, times=1)  # signed with KEY
    rotated = keyed.replace(message_key=OTHER_KEY, message_key_previous=KEY)
    log = tmp_path / "worker.log"
    worker = start_worker(rotated, APP, log)
    try:
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, alive=[worker])
    finally:
        stop_process(worker)
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert "PIPELINE_MESSAGE_KEY is not set" not in log.read_text()


def test_without_a_key_messages_run_unsigned_and_the_worker_says_so(
    engine, inbox_settings: Settings, tmp_path
):
    produce(engine, [NewEvent("entry.booked", {"order_id": "unsigned"})])
    publish_repeated(inbox_settings, times=1)
    assert "pipelinesignature" not in queue_envelopes(inbox_settings, QUEUE)[0]
    log = tmp_path / "worker.log"
    worker = start_worker(inbox_settings, APP, log)
    try:
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, alive=[worker])
    finally:
        stop_process(worker)
    warnings = [line for line in log.read_text().splitlines() if "PIPELINE_MESSAGE_KEY" in line]
    assert len(warnings) == 1, warnings
    assert "not authenticated" in warnings[0]
