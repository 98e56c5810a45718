"""What observability costs end to end, in rounds: each mode against ``off`` in the same round.

This machine's speed drifts by tens of percent within minutes, so a single pair of runs
cannot show a 10 % difference. This runs ``benchmarks.end_to_end`` (closed loop) over
``--rounds`` rounds; every round runs each mode once, the order rotated from round to
round so that no mode always runs first or last. For each mode it reports the ratio of
its throughput and of the machine's CPU per event to the ``off`` run of the same round:
the median, the mean and a bootstrap 95 % confidence interval of the mean (resampling
rounds). Throughput is taken two ways: end to end (every event, from the first commit
until the last is handled) and within the producing window (handled while producers
ran, which a backlog left at the window's end lowers). A goal such as "at most 10 % of
throughput" is shown only when the whole interval lies at or above 0.90.

    .venv/bin/python -m benchmarks.overhead --rounds 10 --modes off,default,sampled,on
    .venv/bin/python -m benchmarks.overhead --from benchmarks/results/some_end_to_end.json

``--from`` summarises an ``end_to_end`` report whose ``--observability`` list was rounds
of the same modes. Writes ``benchmarks/results/overhead.json`` unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import end_to_end

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP_SAMPLES = 10_000


def rotated_order(modes: Sequence[str], rounds: int) -> list[str]:
    """``modes`` ``rounds`` times, each round starting one mode later than the last."""
    count = len(modes)
    return [modes[(start + i) % count] for start in range(rounds) for i in range(count)]


def rounds_of(results: dict[str, Any], modes: Sequence[str]) -> list[dict[str, dict[str, Any]]]:
    """The report's runs grouped into rounds (consecutive runs, one per mode)."""
    runs = [(key.removeprefix("observability_"), value) for key, value in results.items()]
    if len(runs) % len(modes):
        raise SystemExit(f"{len(runs)} runs are not whole rounds of {len(modes)} modes")
    grouped: list[dict[str, dict[str, Any]]] = []
    for start in range(0, len(runs) - len(modes) + 1, len(modes)):
        chunk = runs[start : start + len(modes)]
        by_mode = {name.rsplit("_", 1)[0] if name[-1].isdigit() else name: v for name, v in chunk}
        if sorted(by_mode) != sorted(modes):
            raise SystemExit(f"runs {start}-{start + len(modes) - 1} are not one round of {modes}")
        grouped.append({mode: run["throughput"] for mode, run in by_mode.items()})
    return grouped


def bootstrap_interval(values: Sequence[float], seed: int = 1) -> tuple[float, float]:
    """95 % interval of the mean, by resampling ``values`` with replacement."""
    rng = random.Random(seed)
    means = sorted(
        statistics.fmean(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_SAMPLES)
    )
    return means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]


def _ratios(values: Sequence[float]) -> dict[str, Any]:
    low, high = bootstrap_interval(values)
    return {
        "median": round(statistics.median(values), 3),
        "mean": round(statistics.fmean(values), 3),
        "ci95_of_mean": [round(low, 3), round(high, 3)],
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "each_round": [round(v, 3) for v in values],
    }


# What each ratio divides: events processed per second from the first commit until the
# last event is handled (the whole run), events handled per second within the producing
# window (sensitive to a backlog left at its end), and the machine's CPU per event.
MEASURES = {
    "end_to_end_throughput_ratio": "end_to_end_per_s",
    "in_window_throughput_ratio": "processed_per_s_in_window",
    "cpu_per_event_ratio": "machine_cpu_ms_per_event",
}


def summarise(grouped: list[dict[str, dict[str, Any]]], baseline: str = "off") -> dict[str, Any]:
    """Per mode: each measure as a ratio to the baseline run of the same round."""
    summary: dict[str, Any] = {}
    for mode in [mode for mode in grouped[0] if mode != baseline]:
        summary[mode] = {"rounds": len(grouped)}
        for name, field in MEASURES.items():
            summary[mode][name] = _ratios([r[mode][field] / r[baseline][field] for r in grouped])
        summary[mode]["within_10_percent_shown"] = {
            name: summary[mode][name]["ci95_of_mean"][0] >= 0.90
            for name in MEASURES
            if name.endswith("throughput_ratio")
        }
    summary[baseline] = {
        field: [r[baseline][field] for r in grouped]
        for field in (*MEASURES.values(), "speed_probe_ms")
    }
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="off,default,sampled,on")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--events-per-transaction", type=int, default=10)
    parser.add_argument("--from", dest="source", help="summarise this end_to_end report instead")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/overhead.json"))
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if "off" not in modes:
        raise SystemExit("--modes must include off, the baseline")
    if args.source:
        source = Path(args.source)
    else:
        source = Path(tempfile.mkdtemp(prefix="pipeline-overhead-")) / "end_to_end.json"
        end_to_end_argv = [
            "--only",
            "throughput",
            "--duration",
            str(args.duration),
            "--events-per-transaction",
            str(args.events_per_transaction),
            "--observability",
            ",".join(rotated_order(modes, args.rounds)),
            "--output",
            str(source),
        ]
        end_to_end.main(end_to_end_argv)
        end_to_end_command = " ".join(
            [sys.executable, "-m", "benchmarks.end_to_end", *end_to_end_argv]
        )
    report = json.loads(source.read_text())
    report = report.get("end_to_end_report", report)  # an earlier overhead report will do
    if args.source:
        end_to_end_command = report["command"]
    summary = summarise(rounds_of(report["results"], modes))
    out = {
        "benchmark": "overhead",
        "date": report["date"],
        "code": report["code"],
        "command": " ".join([sys.executable, "-m", "benchmarks.overhead", *(argv or sys.argv[1:])]),
        "end_to_end_command": end_to_end_command,
        "durability": report["durability"],
        "setup": report["setup"],
        "summary": summary,
        "end_to_end_report": report,
    }
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "off"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
