"""The demo's named queries (``queries.sql``, with the harness's shared ones)."""

from __future__ import annotations

from pipeline.tools.harness.sql import WorkflowQueries


class DemoQueries(WorkflowQueries):
    """Queries with ``{schema}`` (the pipeline's) and ``{app}`` (the business tables') filled in."""

    package = "pipeline.tools.demo"
