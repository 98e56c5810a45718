"""Deterministic idempotency keys for calls to external APIs.

The key depends only on (consumer, event id[, step]), so every retry of the same
handler step sends the same key, and a payment API that honours ``Idempotency-Key``
charges once however often the handler runs (DESIGN I3).
"""

from __future__ import annotations

import uuid

# A fixed namespace: keys stay stable across versions and deployments.
_NAMESPACE = uuid.UUID("6f1c3f2e-5b1a-4c7e-9a51-2f7d6c0b8e11")


def idempotency_key(consumer: str, event_id: uuid.UUID, step: str | None = None) -> str:
    """A UUIDv5 string for (consumer, event[, step])."""
    name = f"{consumer}:{event_id}" if step is None else f"{consumer}:{event_id}:{step}"
    return str(uuid.uuid5(_NAMESPACE, name))
