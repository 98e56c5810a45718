"""Grafana dashboard JSON, built from plain dictionaries (current schema, version 39).

Only what the pipeline's dashboards use: a ``datasource`` variable, ``job`` and
``instance`` query variables (multi-select, "All" matching ``.+``, labelled as Grafana's
dashboard-linter expects), read-only dashboards (its ``uneditable-dashboard`` rule), time series and
stat panels in rows, panel links and data links. Panel ids and grid positions are
assigned in order, so a dashboard is a list of rows and panels, nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24

Json = dict[str, Any]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Link:
    title: str
    url: str


@dataclass
class Panel:
    """A time series or stat panel; ``width``/``height`` in grid units (24 per row)."""

    kind: str
    title: str
    description: str
    unit: str
    queries: Sequence[Query]
    width: int = 12
    height: int = 8
    links: Sequence[Link] = ()
    data_links: Sequence[Link] = ()
    thresholds: Sequence[tuple[float | None, str]] = ((None, "green"),)
    mappings: Sequence[Json] = ()
    options: Json = field(default_factory=dict)


@dataclass
class Row:
    title: str
    panels: Sequence[Panel]


def timeseries(title: str, description: str, unit: str, *queries: Query, **extra: Any) -> Panel:
    return Panel("timeseries", title, description, unit, queries, **extra)


def stat(title: str, description: str, unit: str, *queries: Query, **extra: Any) -> Panel:
    extra.setdefault("width", 4)
    extra.setdefault("height", 4)
    return Panel("stat", title, description, unit, queries, **extra)


# -- variables ------------------------------------------------------------------------------


def datasource_variable() -> Json:
    return {
        "current": {},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


def query_variable(name: str, label: str, query: str) -> Json:
    """A multi-select label variable whose "All" is ``.+`` (dashboard-linter's rule)."""
    return {
        "allValue": ".+",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": dict(DATASOURCE),
        "definition": query,
        "hide": 0,
        "includeAll": True,
        "label": label,
        "multi": True,
        "name": name,
        "options": [],
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def textbox_variable(name: str, label: str, value: str) -> Json:
    return {
        "current": {"selected": False, "text": value, "value": value},
        "hide": 0,
        "label": label,
        "name": name,
        "options": [{"selected": True, "text": value, "value": value}],
        "query": value,
        "skipUrlSync": False,
        "type": "textbox",
    }


# -- panels ---------------------------------------------------------------------------------


def _target(query: Query, ref: str, instant: bool) -> Json:
    return {
        "datasource": dict(DATASOURCE),
        "editorMode": "code",
        "expr": query.expr,
        "instant": instant,
        "legendFormat": query.legend or "__auto",
        "range": not instant,
        "refId": ref,
    }


def _links(links: Iterable[Link]) -> list[Json]:
    return [{"targetBlank": True, "title": link.title, "url": link.url} for link in links]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> Json:
    instant = panel.kind == "stat"
    defaults: Json = {
        "color": {"mode": "thresholds" if instant else "palette-classic"},
        "links": _links(panel.data_links),
        "mappings": list(panel.mappings),
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": color, "value": value} for value, color in panel.thresholds],
        },
        "unit": panel.unit,
    }
    options: Json
    if instant:
        options = {
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        }
    else:
        defaults["custom"] = {
            "drawStyle": "line",
            "fillOpacity": 10,
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": False,
        }
        options = {
            "legend": {
                "calcs": [],
                "displayMode": "list",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    options.update(panel.options)
    refs = "ABCDEFGHIJ"
    return {
        "datasource": dict(DATASOURCE),
        "description": panel.description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "id": panel_id,
        "links": _links(panel.links),
        "options": options,
        "targets": [_target(q, refs[i], instant) for i, q in enumerate(panel.queries)],
        "title": panel.title,
        "type": panel.kind,
    }


def layout(rows: Sequence[Row]) -> list[Json]:
    """Rows and their panels, left to right, wrapping at the grid's width."""
    panels: list[Json] = []
    y = 0
    next_id = 1
    for row in rows:
        panels.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "id": next_id,
                "panels": [],
                "title": row.title,
                "type": "row",
            }
        )
        next_id += 1
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                y, x, line_height = y + line_height, 0, 0
            panels.append(_panel_json(panel, next_id, x, y))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return panels


def dashboard(
    uid: str,
    title: str,
    description: str,
    variables: Sequence[Json],
    rows: Sequence[Row],
    links: Sequence[Link],
) -> Json:
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": description,
        "editable": False,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [
            {
                "asDropdown": False,
                "icon": "external link",
                "includeVars": True,
                "keepTime": True,
                "tags": ["pipeline"],
                "targetBlank": False,
                "title": "Pipeline dashboards",
                "type": "dashboards",
            },
            *(
                {
                    "asDropdown": False,
                    "icon": "doc",
                    "includeVars": False,
                    "keepTime": False,
                    "tags": [],
                    "targetBlank": True,
                    "title": link.title,
                    "tooltip": "",
                    "type": "link",
                    "url": link.url,
                }
                for link in links
            ),
        ],
        "liveNow": False,
        "panels": layout(rows),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["pipeline"],
        "templating": {"list": list(variables)},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }
