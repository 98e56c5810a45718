"""Condense one sitting (``benchmarks/sitting.sh``) into ``summary.json`` and a table.

Reads the reports the sitting wrote into one folder: the peers comparison on a quiet
machine (``peers.json``) and beside a CPU hog (``peers_contended.json``), the idle
pipeline's CPU (``idle.json``), the tracing overhead (``overhead_1_per_tx.json``), the
producer/handler API pairs (``api_<api>_round_<n>.json``) and the relay's throughput rounds
(``relay_round_<n>.json``). Every figure keeps its per-round values next to the median,
so a reader sees the spread a shared machine gives, not one lucky run. The summary only
restates the reports; a report that is missing is named, not guessed.

    python -m benchmarks.sitting_summary benchmarks/results/sitting
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import spread

SITTINGS = {"quiet": "peers.json", "contended": "peers_contended.json"}
"""The peers comparison on a quiet machine, and beside a CPU hog of one core."""


@dataclass(frozen=True)
class Goal:
    """A target for a figure that every round of a sitting must meet."""

    target: float
    at_most: bool  # True: the figure must not exceed the target; False: reach it


GOALS = {
    "throughput_over_pgqueuer": Goal(2.0, at_most=False),
    "p50_at_200_over_pgqueuer": Goal(1.5, at_most=True),
    "p99_at_200_over_pgqueuer": Goal(2.0, at_most=True),
    "p99_at_1000_over_pgqueuer": Goal(2.0, at_most=True),
    "cpu_per_event_at_200_over_full_throughput": Goal(2.0, at_most=True),
    "throughput_over_pgbench_commits": Goal(0.25, at_most=False),
    "relay_events_per_s": Goal(50_000.0, at_most=False),
    "idle_relay_and_workers_percent_of_one_core": Goal(1.0, at_most=True),
}
QUIET_ONLY = {"p99_at_1000_over_pgqueuer"}
"""At 1,000 events/s both systems queue on a contended machine: compared quiet only."""


def api_pairs(folder: Path) -> dict[str, Any]:
    """End-to-end throughput and CPU per event for each producer/handler API, by round."""
    by_api: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for path in folder.glob("api_*_round_*.json"):
        match = re.fullmatch(r"api_(\w+?)_round_(\d+)\.json", path.name)
        if match is None:
            continue
        throughput = json.loads(path.read_text())["results"]["observability_default"]
        by_api[match.group(1)][int(match.group(2))] = throughput["throughput"]
    summary: dict[str, Any] = {}
    for api, rounds in sorted(by_api.items()):
        ordered = [rounds[n] for n in sorted(rounds)]
        components: dict[str, list[float]] = defaultdict(list)
        for run in ordered:
            for name, value in run["cpu_ms_per_event_by_component"].items():
                components[name].append(value)
        summary[api] = {
            "end_to_end_per_s": spread([run["end_to_end_per_s"] for run in ordered]),
            "machine_cpu_ms_per_event": spread(
                [run["machine_cpu_ms_per_event"] for run in ordered]
            ),
            "cpu_ms_per_event_by_component": {
                name: spread(values) for name, values in sorted(components.items())
            },
        }
    if {"core", "session"} <= set(by_api):
        common = sorted(set(by_api["core"]) & set(by_api["session"]))
        summary["session_over_core"] = {
            "end_to_end_per_s": spread(
                [
                    round(
                        by_api["session"][n]["end_to_end_per_s"]
                        / by_api["core"][n]["end_to_end_per_s"],
                        3,
                    )
                    for n in common
                ]
            ),
            "machine_cpu_ms_per_event": spread(
                [
                    round(
                        by_api["session"][n]["machine_cpu_ms_per_event"]
                        / by_api["core"][n]["machine_cpu_ms_per_event"],
                        3,
                    )
                    for n in common
                ]
            ),
        }
    return summary


def relay_rounds(folder: Path) -> dict[str, Any]:
    """Relay events/s per (batch size, drainers) over the rounds."""
    cells: dict[str, list[float]] = defaultdict(list)
    phases: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(folder.glob("relay_round_*.json")):
        for run in json.loads(path.read_text())["throughput"]["runs"]:
            key = f"batch {run['batch_size']}, {run['drainers']} drainer(s)"
            cells[key].append(run["events_per_s"])
            phases[key].append(run.get("phases", {}))
    return {
        key: {"events_per_s": spread(values), "phases_by_round": phases[key]}
        for key, values in sorted(cells.items())
    }


def ten_per_transaction(folder: Path) -> dict[str, Any] | None:
    """End to end at ten events per producer transaction: throughput and 1,000/s latency."""
    runs = [
        json.loads(path.read_text())["results"]["observability_default"]
        for path in sorted(folder.glob("ten_per_tx_round_*.json"))
    ]
    if not runs:
        return None
    latency = [run["latency"][0]["latency_ms"] for run in runs]
    return {
        "end_to_end_per_s": spread([run["throughput"]["end_to_end_per_s"] for run in runs]),
        "machine_cpu_ms_per_event": spread(
            [run["throughput"]["machine_cpu_ms_per_event"] for run in runs]
        ),
        "p50_ms_at_1000": spread([figures["p50"] for figures in latency]),
        "p99_ms_at_1000": spread([figures["p99"] for figures in latency]),
    }


def peers(folder: Path, name: str = "peers.json") -> list[dict[str, Any]] | None:
    path = folder / name
    if not path.exists():
        return None
    rows: list[dict[str, Any]] = json.loads(path.read_text())["summary"]
    return rows


def idle(folder: Path) -> dict[str, Any] | None:
    """The idle pipeline's CPU over the rounds of ``idle.json`` (``end_to_end --only idle``)."""
    path = folder / "idle.json"
    if not path.exists():
        return None
    results = json.loads(path.read_text())["results"].values()
    key = "relay_and_workers_percent_of_one_core"
    return spread([run["idle"][key] for run in results if "idle" in run])


def overhead(folder: Path) -> dict[str, Any] | None:
    path = folder / "overhead_1_per_tx.json"
    if not path.exists():
        return None
    summary: dict[str, Any] = json.loads(path.read_text())["summary"]
    return summary


def row_of(rows: Sequence[dict[str, Any]] | None, system: str) -> dict[str, Any] | None:
    """The system's row (the pipeline's first, as shipped: its label names the mode)."""
    return next(
        (
            row
            for row in rows or []
            if row["system"] == system
            or (system == "pipeline" and row["system"].startswith("pipeline"))
        ),
        None,
    )


def per_round(ours: Sequence[float | None], theirs: Sequence[float | None]) -> list[float | None]:
    """Our figure over theirs within each round (same minutes, same load)."""
    return [
        round(a / b, 3) if a is not None and b else None for a, b in zip(ours, theirs, strict=True)
    ]


def peer_goals(rows: Sequence[dict[str, Any]] | None, quiet: bool) -> dict[str, Any]:
    """The sitting's ratios, round by round: the pipeline against pgqueuer and pgbench, and
    its CPU per event at 200 events/s against that at full throughput."""
    pipeline, pgqueuer = row_of(rows, "pipeline"), row_of(rows, "pgqueuer")
    pgbench = row_of(rows, "pgbench")
    found: dict[str, list[float | None]] = {}
    if pipeline is None:
        return {}
    throughput = pipeline["events_per_s_over_rounds"]["by_round"]
    latency = pipeline.get("latency_over_rounds", {})
    if pgqueuer is not None and "events_per_s_over_rounds" in pgqueuer:
        found["throughput_over_pgqueuer"] = per_round(
            throughput, pgqueuer["events_per_s_over_rounds"]["by_round"]
        )
        theirs = pgqueuer.get("latency_over_rounds", {})
        for name, rate, figure in (
            ("p50_at_200_over_pgqueuer", "200", "p50_ms"),
            ("p99_at_200_over_pgqueuer", "200", "p99_ms"),
            ("p99_at_1000_over_pgqueuer", "1000", "p99_ms"),
        ):
            if rate in latency and rate in theirs and (quiet or name not in QUIET_ONLY):
                found[name] = per_round(
                    latency[rate][figure]["by_round"], theirs[rate][figure]["by_round"]
                )
    if "200" in latency and "machine_cpu_ms_per_event" in latency["200"]:
        found["cpu_per_event_at_200_over_full_throughput"] = per_round(
            latency["200"]["machine_cpu_ms_per_event"]["by_round"],
            pipeline["machine_cpu_ms_per_event_over_rounds"]["by_round"],
        )
    if pgbench is not None and "events_per_s_over_rounds" in pgbench:
        found["throughput_over_pgbench_commits"] = per_round(
            throughput, pgbench["events_per_s_over_rounds"]["by_round"]
        )
    return {name: spread(values) for name, values in found.items()}


def goals(summary: dict[str, Any]) -> dict[str, Any]:
    """Each goal of the performance work against the sitting's rounds: the median, and
    whether every round meets it (the peers' goals once per sitting, quiet and contended)."""
    figures: dict[str, Any] = {}
    for sitting in SITTINGS:
        for name, spread_ in peer_goals(summary["peers"].get(sitting), sitting == "quiet").items():
            figures[f"{sitting}: {name}"] = (name, spread_)
    relay = summary["relay"]
    if relay:
        best = max(relay.values(), key=lambda cell: cell["events_per_s"]["median"])
        figures["relay_events_per_s"] = ("relay_events_per_s", best["events_per_s"])
    if summary["idle"]:
        name = "idle_relay_and_workers_percent_of_one_core"
        figures[name] = (name, summary["idle"])
    result: dict[str, Any] = {}
    for label, (name, values) in figures.items():
        goal = GOALS[name]
        if values["median"] is None:
            continue
        worst = values["max"] if goal.at_most else values["min"]
        result[label] = {
            "goal": goal.target,
            "at_most": goal.at_most,
            **values,
            "median_meets_goal": _meets(values["median"], goal.target, goal.at_most),
            "every_round_meets_goal": _meets(worst, goal.target, goal.at_most),
        }
    return result


def _meets(value: float, goal: float, at_most: bool) -> bool:
    return value <= goal if at_most else value >= goal


def _figure(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value >= 100:
        return f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _span(figures: dict[str, Any]) -> str:
    """``median [min-max]`` of a spread."""
    return f"{_figure(figures['median'])} [{_figure(figures['min'])}-{_figure(figures['max'])}]"


def peers_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One sitting's peers: drained rate and CPU per event, latency at each offered rate."""
    out = ["| system | events/s | CPU ms/event | rate | p50 ms | p99 ms | commits/s |"]
    out.append("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "events_per_s_over_rounds" not in row:
            continue
        head = [
            row["system"],
            _span(row["events_per_s_over_rounds"]),
            _span(row["machine_cpu_ms_per_event_over_rounds"]),
        ]
        rates = sorted(row.get("latency_over_rounds", {}).items(), key=lambda r: int(r[0]))
        if not rates:
            out.append("| " + " | ".join([*head, "", "", "", ""]) + " |")
        for index, (rate, latency) in enumerate(rates):
            cells = [rate, _span(latency["p50_ms"]), _span(latency["p99_ms"])]
            commits = latency.get("commits_per_s")
            cells.append(_span(commits) if commits else "")
            out.append("| " + " | ".join((head if index == 0 else ["", "", ""]) + cells) + " |")
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The sitting's tables, for docs/benchmarks.md (figures as in summary.json)."""
    out = ["| goal | target | median [range] over rounds | median meets | every round meets |"]
    out.append("|---|---:|---:|---|---|")
    for name, figures in summary["goals"].items():
        out.append(
            f"| {name} | {_figure(figures['goal'])} | {_span(figures)} | "
            f"{'yes' if figures['median_meets_goal'] else 'no'} | "
            f"{'yes' if figures['every_round_meets_goal'] else 'no'} |"
        )
    for sitting, rows in summary["peers"].items():
        if rows:
            out += ["", f"{sitting} machine:", ""]
            out += peers_table(rows)
    api = summary["api"]
    if api:
        out += ["", "| producer and handler API | events/s | CPU ms/event |", "|---|---:|---:|"]
        for name in ("core", "session"):
            if name in api:
                figures = api[name]
                out.append(
                    f"| {name} | {_span(figures['end_to_end_per_s'])} | "
                    f"{_span(figures['machine_cpu_ms_per_event'])} |"
                )
        components = api.get("core", {}).get("cpu_ms_per_event_by_component", {})
        if components:
            out += ["", "| component (core API) | CPU ms/event |", "|---|---:|"]
            ranked = sorted(components.items(), key=lambda item: -item[1]["median"])
            out += [f"| {name} | {_span(figures)} |" for name, figures in ranked]
    ten = summary["ten_per_transaction"]
    if ten:
        out += ["", "| ten events per transaction | median [range] |", "|---|---:|"]
        out += [f"| {name} | {_span(figures)} |" for name, figures in ten.items()]
    if summary["relay"]:
        out += ["", "| relay | events/s |", "|---|---:|"]
        out += [
            f"| {key} | {_span(cell['events_per_s'])} |" for key, cell in summary["relay"].items()
        ]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    folder = Path(args[0] if args else "benchmarks/results/sitting")
    summary: dict[str, Any] = {
        "folder": str(folder),
        "log": (folder / "sitting.log").read_text() if (folder / "sitting.log").exists() else "",
        "peers": {sitting: peers(folder, name) for sitting, name in SITTINGS.items()},
        "idle": idle(folder),
        "tracing_overhead": overhead(folder),
        "api": api_pairs(folder),
        "relay": relay_rounds(folder),
        "ten_per_transaction": ten_per_transaction(folder),
    }
    summary["goals"] = goals(summary)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (folder / "summary.md").write_text(markdown(summary))
    for name, figures in summary["goals"].items():
        print(
            f"{name:40} goal {figures['goal']:>9} median {figures['median']:>9} "
            f"[{figures['min']}-{figures['max']}] every round: {figures['every_round_meets_goal']}"
        )
    print(f"wrote {folder / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
