"""Named SQL queries from ``queries.sql``, rendered once per schema.

Queries live in one ``.sql`` file with ``-- name: x`` headers so they can be read and
reviewed as SQL; the schema name is spliced in as a quoted identifier, never by
string formatting of user input.
"""

from __future__ import annotations

import re
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
)


@lru_cache(maxsize=1)
def _raw_queries() -> dict[str, str]:
    queries: dict[str, str] = {}
    for filename in QUERY_FILES:
        text = (resources.files("pipeline.db") / filename).read_text("utf-8")
        parts = _HEADER.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"query {name!r} is defined twice")
            queries[name] = body.strip()
    return queries


class Queries:
    """The named queries, rendered to bytes once (psycopg executes bytes as they are).

    A ``Composed`` query is rendered again on every execution, which cost the relay a
    few percent of its CPU on its hottest statements.
    """

    def __init__(self, schema: str) -> None:
        quoted = sql.Identifier(validate_identifier(schema, "schema name"))
        self.schema = schema
        self._text = {
            name: sql.SQL(body.replace("{schema}", "{schema_ident}"))
            .format(schema_ident=quoted)
            .as_string()
            for name, body in _raw_queries().items()
        }
        self._bytes = {name: text.encode() for name, text in self._text.items()}

    def __getitem__(self, name: str) -> bytes:
        return self._bytes[name]

    def text(self, name: str) -> str:
        """The query as a string, for drivers reached through SQLAlchemy's ``exec_driver_sql``."""
        return self._text[name]


@lru_cache(maxsize=8)
def queries_for(schema: str) -> Queries:
    return Queries(schema)
