"""``python -m pipeline.tools.opskit``: the ``pipeline opskit`` command under its old name."""

from pipeline.tools.cli.opskit import opskit

opskit.main(prog_name="python -m pipeline.tools.opskit")
