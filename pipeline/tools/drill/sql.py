"""The drill's named queries (``queries.sql``, with the harness's shared ones)."""

from __future__ import annotations

from pipeline.tools.harness.sql import WorkflowQueries


class DrillQueries(WorkflowQueries):
    """Queries with ``{schema}`` (the pipeline's) and ``{app}`` (the drill's tables) filled in."""

    package = "pipeline.tools.drill"
