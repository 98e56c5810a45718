"""Text from events and the queues, made safe to print on an operator's terminal.

Event fields (``aggregate_id``, ``aggregate_type``, event types, consumer names, error
messages) are data anyone who can add an event or write to the broker controls. Printed
raw, an escape sequence could retitle the terminal, hide or recolour text, and a newline
could print a fake line of output. Every human-readable report therefore passes its lines
through :func:`printable`, which shows such characters escaped (``\\x1b``, ``\\n``,
``\\u202e``) instead of sending them to the terminal. JSON output needs no such step:
``json.dumps`` escapes them itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# C0 and C1 control characters (newline and tab included), DEL, and the invisible
# direction marks and overrides that reorder what the terminal shows.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, keep: str = "") -> str:
    """``text`` with every control or direction character escaped, except those in ``keep``."""
    if keep:
        return "".join(
            part if part in keep else _UNPRINTABLE.sub(_escaped, part)
            for part in re.split(f"([{re.escape(keep)}])", text)
        )
    return _UNPRINTABLE.sub(_escaped, text)


def printable_lines(lines: Iterable[str]) -> str:
    """Report lines joined by newlines, each made :func:`printable` (a field's own newline
    cannot start a line of its own)."""
    return "\n".join(printable(line) for line in lines)
