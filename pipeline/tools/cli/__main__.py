"""``python -m pipeline.tools.cli``: the ``pipeline`` command without its console script."""

from pipeline.tools.cli.main import main

main()
