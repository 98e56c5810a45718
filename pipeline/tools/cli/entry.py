"""How a command line ends: the exit code, and one clear line for anything expected.

Expected failures (:class:`PipelineError`) print one line on stderr and exit 1; usage
errors print one line too and exit 2 (click's convention); Ctrl-C exits 130. Tracebacks
are kept for real bugs. The commands get this behaviour through their class, so that
``main(argv)``, click's ``CliRunner`` and ``python -m`` all behave as the console script.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import click

from pipeline.errors import PipelineError
from pipeline.tools.ops.text import printable


class OneLineErrors(click.Command):
    """A command whose standalone run ends as described above."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)

        def run() -> Any:
            return super(OneLineErrors, self).main(args, prog_name, complete_var, False, **extra)

        finish(run, prog_name or self.name or "pipeline")


class OneLineErrorsGroup(OneLineErrors, click.Group):
    """A group of commands (``pipeline``) whose standalone run ends as described above."""


def finish(run: Callable[[], Any], prog: str) -> NoReturn:
    """Run a click ``main`` in non-standalone mode and exit as described above."""
    try:
        result: Any = run()
        sys.exit(result if isinstance(result, int) else 0)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # one line, and where to read more
        path = exc.ctx.command_path if exc.ctx is not None else prog
        click.echo(f"{prog}: error: {exc.format_message()} (see '{path} --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except PipelineError as exc:  # its text may quote data: control characters escaped
        click.echo(f"{prog}: error: {printable(str(exc), keep=chr(10))}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        from pipeline.driver_errors import permission_denied

        denied = permission_denied(exc)  # a grant revoked while running, or a read refused
        if denied is None:
            raise
        click.echo(f"{prog}: error: {denied}", err=True)
        sys.exit(1)
