"""Upcasters: handlers always see the newest version of an event's payload.

An upcaster turns version N of a payload into version N+1; a chain of them brings
an old event (still in a queue, or replayed from the dead letters) up to date.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pipeline.errors import ConfigurationError

Upcaster = Callable[[Any], Any]


class Upcasters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[tuple[str, int], Upcaster] = {}

    def register(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Decorator: ``@upcaster("order.placed", from_version=1)`` turns v1 into v2."""

        def decorate(function: Upcaster) -> Upcaster:
            with self._lock:
                if (event_type, from_version) in self._steps:
                    raise ConfigurationError(
                        f"two upcasters for {event_type!r} from version {from_version}"
                    )
                self._steps[(event_type, from_version)] = function
            return function

        return decorate

    def upcast(self, event_type: str, version: int, payload: Any) -> tuple[int, Any]:
        """Apply every registered step from ``version``; returns (new version, payload)."""
        while (step := self._steps.get((event_type, version))) is not None:
            payload = step(payload)
            version += 1
        return version, payload


upcasters = Upcasters()
upcaster = upcasters.register
