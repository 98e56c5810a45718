"""One named-SQL loader for the engine and the tools; outbox rows map to events one way."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from pipeline.db.queries import load_sql, queries_for, render_sql
from pipeline.envelope import OutboxEvent
from pipeline.errors import ConfigurationError
from pipeline.tools.demo.sql import DemoQueries
from pipeline.tools.drill.sql import DrillQueries


def test_placeholders_become_quoted_identifiers():
    rendered = render_sql("SELECT 1 FROM {schema}.t JOIN {app}.u USING (id)", schema="p", app="a")
    assert rendered == 'SELECT 1 FROM "p".t JOIN "a".u USING (id)'


def test_a_hostile_identifier_never_reaches_the_sql():
    with pytest.raises(ConfigurationError, match="invalid app name"):
        render_sql("SELECT 1 FROM {app}.t", app='x"; DROP TABLE t; --')


def test_a_name_defined_twice_is_refused():
    with pytest.raises(RuntimeError, match="defined twice"):
        load_sql(("pipeline.db", "queries.sql"), ("pipeline.db", "queries.sql"))


def test_engine_and_tools_queries_load_through_the_one_loader():
    engine = queries_for("pipeline_x")
    assert engine["claim"] == engine.text("claim").encode()
    assert '"pipeline_x".claim_outbox(' in engine.text("claim")
    assert engine["claim"] is queries_for("pipeline_x")["claim"]  # rendered once per schema
    demo = DemoQueries("pipeline_x", "demo_app")
    assert '"demo_app".' in demo.text("place_order")
    assert demo.text("drop_schema", app="other_app").endswith('"other_app" CASCADE;')
    drill = DrillQueries("pipeline_x", "drill_app")
    assert '"drill_app".' in drill.text("place_order")


def test_an_outbox_row_maps_to_an_event_in_the_stores_column_order():
    event_id, created = uuid.uuid4(), datetime.now(UTC)
    row = (event_id, 3, "order", "o-1", "order:o-1", "order.placed", 2, '{"n":1}', None, 1)
    event = OutboxEvent.from_row((*row, created, "ignored extra column"))
    assert event == OutboxEvent(
        id=event_id,
        seq=3,
        aggregate_type="order",
        aggregate_id="o-1",
        ordering_key="order:o-1",
        event_type="order.placed",
        event_version=2,
        payload_json='{"n":1}',
        headers_json="{}",  # a row without headers reads as none
        attempts=1,
        created_at=created,
    )
    assert event.headers == {}
