"""Compare two versions of the code on one benchmark, in interleaved rounds.

The machine's speed drifts (shared CPUs), so a before/after figure means something only
as a ratio of runs made next to each other. Each round runs the benchmark once from each
source tree (e.g. ``git worktree add /tmp/before <commit>``), in alternating order, and
the report gives, per figure, every round's after/before ratio with its median, mean,
range and a bootstrap 95 % interval of the mean.

```bash
git worktree add /tmp/before <commit>
.venv/bin/python -m benchmarks.compare_code --before /tmp/before --after . --rounds 5 \\
    --benchmark relay -- --only throughput --batch-sizes 500 --events 50000
.venv/bin/python -m benchmarks.compare_code --before /tmp/before --after . --rounds 5 \\
    --benchmark end_to_end -- --only throughput --duration 10 --observability default
```

Each run is a subprocess of this interpreter with the tree as its working directory and
``PYTHONPATH``, so both trees share the installed dependencies and the relay and worker
processes the benchmark starts import the tree's own ``pipeline``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parent.parent
Figures = Callable[[dict[str, Any]], dict[str, float]]


def relay_figures(report: dict[str, Any]) -> dict[str, float]:
    """Per (batch size, drainers) of the relay's throughput section: events/s, and the
    CPU the relay and Postgres spent per event and per batch phase (less disturbed by a
    busy neighbour than events/s)."""
    figures: dict[str, float] = {}
    for run in report["throughput"]["runs"]:
        case = f"batch{run['batch_size']}_drainers{run['drainers']}"
        figures[f"relay_events_per_s_{case}"] = float(run["events_per_s"])
        cpu = run.get("cpu") or {}
        for key in ("relay_cpu_ms_per_event", "postgres_cpu_ms_per_event"):
            if cpu.get(key):
                figures[f"{key}_{case}"] = float(cpu[key])
        for phase, timing in (run.get("phases") or {}).items():
            figures[f"{phase}_ms_per_batch_{case}"] = float(timing["ms_per_batch"])
    return figures


def end_to_end_figures(report: dict[str, Any]) -> dict[str, float]:
    """Throughput, CPU per event and latency percentiles of every end-to-end run."""
    figures: dict[str, float] = {}
    for mode, sections in report["results"].items():
        throughput = sections.get("throughput")
        if throughput:
            figures[f"{mode}_end_to_end_per_s"] = float(throughput["end_to_end_per_s"])
            figures[f"{mode}_cpu_ms_per_event"] = float(throughput["machine_cpu_ms_per_event"])
        for run in sections.get("latency") or []:
            rate = int(run["offered_events_per_s"])
            for key in ("p50", "p99"):
                figures[f"{mode}_latency_at_{rate}_per_s_{key}_ms"] = float(run["latency_ms"][key])
    return figures


BENCHMARKS: dict[str, Figures] = {"relay": relay_figures, "end_to_end": end_to_end_figures}


def run_once(tree: Path, benchmark: str, args: Sequence[str], output: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-m", f"benchmarks.{benchmark}", *args, "--output", str(output)]
    subprocess.run(command, cwd=tree, env=env, check=True)
    report: dict[str, Any] = json.loads(output.read_text())
    return report


def git_head(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or "unknown"


def summarise(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per figure: each side's values and the after/before ratios over the rounds."""
    names = sorted(set.intersection(*(set(r["before"]) & set(r["after"]) for r in rounds)))
    summary: dict[str, Any] = {}
    for name in names:
        ratios = [r["after"][name] / r["before"][name] for r in rounds if r["before"][name]]
        if ratios:
            summary[name] = {
                "before": [r["before"][name] for r in rounds],
                "after": [r["after"][name] for r in rounds],
                "after_over_before": harness.ratios(ratios),
            }
    return summary


def show(summary: dict[str, Any]) -> None:
    for name, figure in summary.items():
        ratio = figure["after_over_before"]
        print(
            f"{name}: after/before median {ratio['median']} mean {ratio['mean']} "
            f"95% {ratio['ci95_of_mean']} range [{ratio['min']}, {ratio['max']}]"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of the baseline")
    parser.add_argument("--after", type=Path, default=ROOT, help="source tree to compare")
    parser.add_argument("--benchmark", choices=sorted(BENCHMARKS), required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/compare.json")
    parser.add_argument(
        "--from-dir",
        type=Path,
        help="summarise the before_N.json/after_N.json reports of an earlier run instead",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the benchmark's options")
    options = parser.parse_args(argv)
    if options.from_dir is not None:
        return summarise_dir(options)
    extra = options.args[1:] if options.args[:1] == ["--"] else options.args
    trees = {"before": options.before.resolve(), "after": options.after.resolve()}
    scratch = Path(tempfile.mkdtemp(prefix="pipeline-compare-"))
    rounds: list[dict[str, dict[str, float]]] = []
    started = time.time()
    for number in range(options.rounds):
        order = ["before", "after"] if number % 2 == 0 else ["after", "before"]
        figures: dict[str, dict[str, float]] = {}
        for label in order:
            report = run_once(
                trees[label], options.benchmark, extra, scratch / f"{label}_{number}.json"
            )
            figures[label] = BENCHMARKS[options.benchmark](report)
        rounds.append(figures)
        print(f"round {number + 1}/{options.rounds}: {json.dumps(figures)}", flush=True)
    result = {
        "benchmark": "compare_code",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([sys.executable, "-m", "benchmarks.compare_code", *sys.argv[1:]]),
        "compared": options.benchmark,
        "benchmark_args": extra,
        "before": {"tree": str(trees["before"]), "commit": git_head(trees["before"])},
        "after": {"tree": str(trees["after"]), "commit": git_head(trees["after"])},
        "rounds": options.rounds,
        "elapsed_s": round(time.time() - started, 1),
        "loadavg_at_end": os.getloadavg(),
        "summary": summarise(rounds),
    }
    harness.write_report(options.output, result)
    show(result["summary"])
    return 0


def summarise_dir(options: argparse.Namespace) -> int:
    """The summary of reports kept from an earlier run (``--from-dir``)."""
    figures = BENCHMARKS[options.benchmark]
    rounds = []
    for number in range(options.rounds):
        pair = {
            label: figures(json.loads((options.from_dir / f"{label}_{number}.json").read_text()))
            for label in ("before", "after")
        }
        rounds.append(pair)
    summary = summarise(rounds)
    options.output.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(options.output.read_text()) if options.output.exists() else {}
    previous["summary"] = summary
    previous["summarised_from"] = str(options.from_dir)
    options.output.write_text(json.dumps(previous, indent=2) + "\n")
    show(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
