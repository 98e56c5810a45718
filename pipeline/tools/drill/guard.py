"""Run a command that ends with the drill.

``python -m pipeline.tools.drill.guard PID -- COMMAND...``.

The drill starts relays, workers and producers from a process with other threads, where a
``preexec_fn`` is unsafe. This small program asks Linux for SIGTERM when its parent (the
thread that started it, PID) dies, checks that the parent is still there, and then
replaces itself with COMMAND, which keeps that request. Elsewhere than Linux the command
just runs and may outlive the drill.
"""

from __future__ import annotations

import os
import sys

from pipeline.childprocess import die_with_parent


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m pipeline.tools.drill.guard PID -- COMMAND [ARGS...]")
    parent = int(argv[0])
    die_with_parent()
    if os.getppid() != parent:  # the drill died before the request took effect
        sys.exit(1)
    os.execvp(argv[2], argv[2:])  # noqa: S606 - the drill's own commands, as given


if __name__ == "__main__":
    main(sys.argv[1:])
