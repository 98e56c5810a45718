"""Named queries of the demo's and the drill's order workflows, rendered for two schemas.

Each workflow keeps its queries in a ``queries.sql`` of its own package (``-- name: x``
headers); the queries both need (a schema of the run's own, live relays) are in this
package's ``queries.sql`` and come with every workflow's. ``{schema}`` is the pipeline's
schema and ``{app}`` the workflow's business schema, spliced in as quoted identifiers by
the engine's named-SQL loader (:mod:`pipeline.db.queries`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

from pipeline.config import validate_identifier
from pipeline.db.queries import load_sql, render_sql

SHARED = "pipeline.tools.harness"


@lru_cache(maxsize=512)
def _render(package: str, name: str, schema: str, app: str) -> str:
    sources = [(source, "queries.sql") for source in dict.fromkeys((SHARED, package))]
    return render_sql(load_sql(*sources)[name], schema=schema, app=app)


class WorkflowQueries:
    """A workflow's queries with ``{schema}`` and ``{app}`` filled in; subclasses name the
    package whose ``queries.sql`` they read."""

    package: ClassVar[str] = SHARED

    def __init__(self, schema: str, app_schema: str) -> None:
        self.schema = validate_identifier(schema, "schema name")
        self.app_schema = validate_identifier(app_schema, "business schema name")

    def text(self, name: str, *, app: str | None = None) -> str:
        """Query ``name`` as a string for psycopg or SQLAlchemy's ``exec_driver_sql``
        (``app`` stands in for the business schema)."""
        target = self.app_schema if app is None else validate_identifier(app, "schema name")
        return _render(self.package, name, self.schema, target)
