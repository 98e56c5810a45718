"""The demo's named queries (``queries.sql``), rendered for one pair of schemas."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

from psycopg import sql

from pipeline.config import validate_identifier

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@lru_cache(maxsize=1)
def _raw() -> dict[str, str]:
    text = (resources.files("pipeline.tools.demo") / "queries.sql").read_text("utf-8")
    parts = _HEADER.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


class DemoQueries:
    """Queries with ``{schema}`` (the pipeline's) and ``{app}`` (the business tables') filled in."""

    def __init__(self, schema: str, app_schema: str) -> None:
        self.schema = validate_identifier(schema, "schema name")
        self.app_schema = validate_identifier(app_schema, "demo schema name")

    def text(self, name: str, *, app: str | None = None) -> str:
        """Query ``name`` as a string for ``exec_driver_sql`` / psycopg (``app`` overrides)."""
        target = self.app_schema if app is None else validate_identifier(app, "schema name")
        return _render(name, self.schema, target)


@lru_cache(maxsize=256)
def _render(name: str, schema: str, app: str) -> str:
    return (
        sql.SQL(_raw()[name])
        .format(schema=sql.Identifier(schema), app=sql.Identifier(app))
        .as_string()
    )
