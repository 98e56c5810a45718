"""Named queries of the demo's and the drill's order workflows, rendered for two schemas.

Each workflow keeps its queries in a ``queries.sql`` of its own package (``-- name: x``
headers); the queries both need (a schema of the run's own, live relays) are in this
package's ``queries.sql`` and come with every workflow's. ``{schema}`` is the pipeline's
schema and ``{app}`` the workflow's business schema, spliced in as quoted identifiers.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources
from typing import ClassVar

from psycopg import sql

from pipeline.config import validate_identifier

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
SHARED = "pipeline.tools.harness"


@lru_cache(maxsize=8)
def _raw(package: str) -> dict[str, str]:
    queries: dict[str, str] = {}
    for source in dict.fromkeys((SHARED, package)):
        text = (resources.files(source) / "queries.sql").read_text("utf-8")
        parts = _HEADER.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"query {name!r} is defined twice ({source})")
            queries[name] = body.strip()
    return queries


@lru_cache(maxsize=512)
def _render(package: str, name: str, schema: str, app: str) -> str:
    return (
        sql.SQL(_raw(package)[name])
        .format(schema=sql.Identifier(schema), app=sql.Identifier(app))
        .as_string()
    )


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
