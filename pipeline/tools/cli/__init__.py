"""The ``pipeline`` command line: one click group, a module per command group.

The commands parse, call :mod:`pipeline.tools.ops` (or the demo and drill runners, or
the ops-kit renderer), render what it returns and set the exit code. ``main(argv)`` and
click's ``CliRunner`` on :data:`cli` run it in-process as the console script does.
"""

from pipeline.tools.cli.main import cli, main

__all__ = ["cli", "main"]
