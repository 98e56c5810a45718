"""The one loader of named SQL: ``.sql`` files with ``-- name: x`` headers.

Queries live in ``.sql`` files so they can be read and reviewed as SQL. Identifiers that
vary (``{schema}``, the demo's ``{app}``, …) are named placeholders spliced in as quoted
identifiers by psycopg, never by string formatting of user input. Any package's files
load the same way: the engine's (``pipeline.db``, reached through the stores in
:mod:`pipeline.db.stores`) and the tools' own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources

from psycopg import sql

from pipeline.config import validate_identifier

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


QUERY_FILES = (
    "queries.sql",
    "inbox.sql",
    "ledger.sql",
    "dlq.sql",
    "retention.sql",
    "diagnostics.sql",
    "unrouted.sql",
)
"""The engine's query files in ``pipeline.db``."""


@lru_cache(maxsize=32)
def load_sql(*sources: tuple[str, str]) -> dict[str, str]:
    """The named queries of the ``(package, filename)`` sources, placeholders left in; a
    name defined twice is an error (a query must be findable by its name)."""
    queries: dict[str, str] = {}
    for package, filename in sources:
        text = (resources.files(package) / filename).read_text("utf-8")
        parts = _HEADER.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"query {name!r} is defined twice ({package}/{filename})")
            queries[name] = body.strip()
    return queries


def render_sql(body: str, **identifiers: str) -> str:
    """``body`` with each ``{placeholder}`` replaced by its identifier, quoted."""
    for name, value in identifiers.items():
        validate_identifier(value, f"{name} name")
    return (
        sql.SQL(body)
        .format(**{name: sql.Identifier(value) for name, value in identifiers.items()})
        .as_string()
    )


class NamedQueries:
    """A set of named queries rendered once for one set of identifiers, as text and bytes.

    psycopg executes bytes as they are: a ``Composed`` query is rendered again on every
    execution, which cost the relay a few percent of its CPU on its hottest statements.
    """

    def __init__(self, sources: Sequence[tuple[str, str]], **identifiers: str) -> None:
        self._text = {
            name: render_sql(body, **identifiers) for name, body in load_sql(*sources).items()
        }
        self._bytes = {name: text.encode() for name, text in self._text.items()}

    def __getitem__(self, name: str) -> bytes:
        return self._bytes[name]

    def text(self, name: str) -> str:
        """The query as a string, for drivers reached through SQLAlchemy's ``exec_driver_sql``."""
        return self._text[name]


class Queries(NamedQueries):
    """The engine's queries for one pipeline schema (used by the stores only)."""

    def __init__(self, schema: str) -> None:
        self.schema = validate_identifier(schema, "schema name")
        super().__init__([("pipeline.db", filename) for filename in QUERY_FILES], schema=schema)


@lru_cache(maxsize=8)
def queries_for(schema: str) -> Queries:
    return Queries(schema)
