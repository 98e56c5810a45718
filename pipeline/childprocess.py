"""Child processes that do not outlive the process that started them."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies (Linux ``prctl``).

    Runs in the child between fork and exec, so it is only safe while the parent has a
    single thread. Elsewhere than Linux it does nothing: the child may outlive its parent.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
