"""Logs never carry payloads, even where Dramatiq formats a whole message."""

from __future__ import annotations

import io
import logging

from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from pipeline.config import Settings
from pipeline.observability.logging import configure_logging


def test_dramatiq_messages_are_logged_by_actor_and_id_not_by_their_payload():
    configure_logging(Settings(log_format="json"))
    handler = logging.getLogger().handlers[0]
    stream = io.StringIO()
    handler.setStream(stream)  # type: ignore[attr-defined]
    message = Message(
        queue_name="pipeline.billing",
        actor_name="pipeline_inbox_billing",
        args=([{"id": "e-1", "data": {"card": "4242-secret"}}],),
        kwargs={},
        options={},
    )
    logging.getLogger("dramatiq.worker.WorkerThread").error(
        "Failed to process message %s with unhandled exception.", MessageProxy(message)
    )
    line = stream.getvalue()
    assert "4242-secret" not in line
    assert f"pipeline_inbox_billing message {message.message_id}" in line
