"""The drill's named queries (``queries.sql``), rendered for one pair of schemas."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

from psycopg import sql

from pipeline.config import validate_identifier

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@lru_cache(maxsize=1)
def _raw() -> dict[str, str]:
    text = (resources.files("pipeline.tools.drill") / "queries.sql").read_text("utf-8")
    parts = _HEADER.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


class DrillQueries:
    """Queries with ``{schema}`` (the pipeline's) and ``{app}`` (the drill's tables) filled in."""

    def __init__(self, schema: str, app_schema: str) -> None:
        self.schema = validate_identifier(schema, "schema name")
        self.app_schema = validate_identifier(app_schema, "drill schema name")

    def text(self, name: str) -> str:
        """Query ``name`` as a string, for psycopg or SQLAlchemy's ``exec_driver_sql``."""
        return _render(name, self.schema, self.app_schema)


@lru_cache(maxsize=128)
def _render(name: str, schema: str, app: str) -> str:
    return (
        sql.SQL(_raw()[name])
        .format(schema=sql.Identifier(schema), app=sql.Identifier(app))
        .as_string()
    )
