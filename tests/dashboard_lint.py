"""A dashboard linter after Grafana's dashboard-linter rules, plus the pipeline's own.

dashboard-linter is a Go program (github.com/grafana/dashboard-linter, not on PyPI or
npm): its rules, as its lint/rule_*.go files state them, are encoded here, errors and
warnings alike. ``lint(board)`` returns one line per problem (empty when clean):

* uneditable-dashboard: ``editable`` is false;
* template-datasource: one datasource variable for Prometheus, named ``datasource`` and
  labelled ``Data source`` (or ``prometheus_datasource`` / ``Prometheus data source``);
* template-job / template-instance: ``job`` and ``instance`` query variables on
  ``$datasource``, multi-select, "All" = ``.+``, labelled ``Job`` and ``Instance``;
* template-on-time-change-reload: every query variable refreshes on time range change
  (``refresh`` 2);
* template-label-promql: every query variable is ``label_values(...)`` (or
  ``label_names``, ``metrics``, ``query_result``);
* panel-datasource, panel-title-description, panel-units, panel-no-targets;
* target-job / target-instance: every selector filters on ``job=~"$job"`` and
  ``instance=~"$instance"``;
* target-rate-interval: every range in a query is ``[$__rate_interval]``;
* target-counter-agg: a ``_total`` counter only inside ``rate()`` or ``increase()``;
* variables used in queries and links are defined; panels do not overlap.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# Grafana's unit ids this project may use (packages/grafana-data valueFormats categories).
UNITS = {
    "short", "none", "percent", "percentunit", "s", "ms", "dtdurations", "bytes",
    "eps", "mps", "ops", "reqps", "cps", "wps", "rps", "bool_on_off", "dateTimeAsIso",
}  # fmt: skip
SELECTOR = re.compile(r"\b(pipeline_[a-z_]+|up)\b(\{[^}]*\})?")
RANGE = re.compile(r"\[([^\]]+)\]")
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__field", "__all"}


def _panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def _variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board.get("templating", {}).get("list", [])}


def _query_text(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    return str(query.get("query", "") if isinstance(query, dict) else query)


def _uses_datasource_variable(ref: Any) -> bool:
    uid = ref.get("uid") if isinstance(ref, dict) else ref
    return uid in ("$datasource", "${datasource}")


def lint_templates(board: dict[str, Any]) -> list[str]:
    problems = []
    if board.get("editable", True):
        problems.append("uneditable-dashboard: is editable, it should be set to 'editable: false'")
    variables = _variables(board)
    sources = [v for v in variables.values() if v.get("type") == "datasource"]
    if len(sources) != 1:
        problems.append("template-datasource: want exactly one data source variable")
    for source in sources:
        if source.get("query") != "prometheus":
            problems.append("template-datasource: query 'prometheus'")
        if source["name"] not in ("datasource", "prometheus_datasource"):
            problems.append(f"template-datasource: variable named {source['name']!r}")
        if source.get("label") not in ("Data source", "Prometheus data source"):
            problems.append(f"template-datasource: labeled {source.get('label')!r}")
    for name in ("job", "instance"):
        variable = variables.get(name)
        if variable is None:
            problems.append(f"template-{name}: no '{name}' variable")
            continue
        if variable.get("type") != "query" or not _uses_datasource_variable(
            variable.get("datasource")
        ):
            problems.append(f"template-{name}: a query variable on $datasource")
        if not variable.get("multi") or variable.get("allValue") != ".+":
            problems.append(f"template-{name}: multi-select with allValue '.+'")
        if variable.get("label") != name.title():
            problems.append(f"template-{name}: label must be '{name.title()}'")
    for variable in variables.values():
        if variable.get("type") != "query":
            continue
        if variable.get("refresh") != 2:
            problems.append(
                f"template-on-time-change-reload: {variable['name']!r} refresh must be 2"
            )
        if not re.fullmatch(
            r"(label_values|label_names|metrics|query_result)\((.+)\)", _query_text(variable)
        ):
            problems.append(f"template-label-promql: {variable['name']!r} query")
    return problems


def lint_expression(expr: str) -> list[str]:
    problems = []
    for match in SELECTOR.finditer(expr):
        name, matchers = match.group(1), match.group(2) or ""
        if 'job=~"$job"' not in matchers:
            problems.append(f'target-job: {name} has no job=~"$job" matcher')
        if 'instance=~"$instance"' not in matchers:
            problems.append(f'target-instance: {name} has no instance=~"$instance" matcher')
        if name.endswith("_total"):
            before = expr[: match.start()].rstrip()
            if not re.search(r"\b(rate|increase)\($", before):
                problems.append(f"target-counter-agg: {name} outside rate()/increase()")
    for window in RANGE.findall(expr):
        if window != "$__rate_interval":
            problems.append(f"target-rate-interval: range [{window}], want [$__rate_interval]")
    return problems


def lint_panel(panel: dict[str, Any]) -> list[str]:
    title = panel.get("title", "")
    problems = []
    if not title or not panel.get("description"):
        problems.append("panel-title-description: title and description required")
    if not _uses_datasource_variable(panel.get("datasource")):
        problems.append("panel-datasource: must use ${datasource}")
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    if unit not in UNITS:
        problems.append(f"panel-units: unit {unit!r} is not a known Grafana unit")
    targets = panel.get("targets", [])
    if not targets:
        problems.append("panel-no-targets: a panel without queries")
    for target in targets:
        if not _uses_datasource_variable(target.get("datasource")):
            problems.append("panel-datasource: every target must use ${datasource}")
        problems += lint_expression(target.get("expr", ""))
    return [f"{title!r}: {problem}" for problem in problems]


def lint_layout(board: dict[str, Any]) -> list[str]:
    problems = []
    taken: set[tuple[int, int]] = set()
    ids = set()
    for panel in board.get("panels", []):
        if panel["id"] in ids:
            problems.append(f"panel id {panel['id']} used twice")
        ids.add(panel["id"])
        pos = panel["gridPos"]
        if pos["x"] + pos["w"] > 24:
            problems.append(f"{panel.get('title')!r} is wider than the grid")
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}  # fmt: skip
        if cells & taken:
            problems.append(f"{panel.get('title')!r} overlaps another panel")
        taken |= cells
    return problems


def lint_variables_used(board: dict[str, Any]) -> list[str]:
    defined = set(_variables(board)) | GRAFANA_BUILTINS
    text = repr(board.get("panels", [])) + repr(board.get("links", []))
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))
    return [f"variable ${name} is used but not defined" for name in sorted(used - defined)]


def lint(board: dict[str, Any]) -> list[str]:
    problems = lint_templates(board) + lint_layout(board) + lint_variables_used(board)
    for panel in _panels(board):
        problems += lint_panel(panel)
    return problems
