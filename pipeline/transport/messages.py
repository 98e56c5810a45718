"""What the inbox reads of a Dramatiq message beyond its public fields.

Every Dramatiq broker hands middleware the same ``MessageProxy``; the worker stuffs the
exception that failed a message into it (``stuff_exception``), and ``before_nack`` gets
no other way to see why a message is rejected. The attribute is private, so it is read
here only, and ``tests/unit/test_dramatiq_contract.py`` checks it.
"""

from __future__ import annotations

from typing import Any


def current_exception(message: Any) -> BaseException | None:
    """The exception that failed ``message`` in the worker processing it now, if any.

    Set for an actor that raised, and for a message naming an actor nobody declared
    (``ActorNotFound``); None when a middleware failed it (an age limit) or it succeeded.
    """
    exception = getattr(message, "_exception", None)
    return exception if isinstance(exception, BaseException) else None
