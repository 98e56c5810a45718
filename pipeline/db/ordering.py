"""Which lock orders an ordering key's events: one of a fixed set, chosen by hashing the key.

The insert trigger (``sequence_ordered_event`` in functions.sql) takes a transaction-level
advisory lock before it numbers an ordered event, so that a key's sequence order is its
commit order. One lock per key ran out of Postgres's lock table (``max_locks_per_transaction``
x connections, 6,400 by default) at ~13,000 keys in one transaction; keys now share
``ORDERING_LOCK_BUCKETS`` locks, so a transaction holds at most that many whatever its size.
The same key always maps to the same lock, which is all the ordering needs; two unrelated
keys that share a lock only make their producers take turns.

The bucket is computed in SQL by the trigger and here by :func:`ordering_lock_bucket` (to
insert a batch in lock order): both hash the key's UTF-8 bytes with SHA-256.
"""

from __future__ import annotations

import hashlib

ORDERING_LOCK_BUCKETS = 1024
ORDERING_LOCK_CLASS = 1885958245  # first key of the two-key advisory lock: the pipeline's


def ordering_lock_bucket(key: str) -> int:
    """The lock bucket of ``key``, as the insert trigger computes it."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:2], "big") % ORDERING_LOCK_BUCKETS
