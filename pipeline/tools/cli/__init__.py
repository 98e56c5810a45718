"""The ``pipeline`` command line: one click group, its sub-commands in modules of this package."""

from pipeline.tools.cli.main import cli, main

__all__ = ["cli", "main"]
