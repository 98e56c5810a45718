"""Where the CPU goes inside each Python process of an end-to-end run (py-spy samples).

``end_to_end.py`` gives CPU per event by process (producers, relay, workers, Postgres,
Redis); this breaks the Python processes down further. It runs ``end_to_end --only
throughput`` under ``py-spy record --subprocesses --gil`` (only samples of threads that
hold the GIL: Python work, not waits) and sorts every sample of the producers, the relay
and the workers into the stages below by the frames on its stack, the first rule that
matches winning. Start-up (imports) is left out. Sampling slows the run, so its
throughput is not a measurement; the shares are.

    pip install py-spy
    python -m benchmarks.profile_split --duration 15 --output benchmarks/results/profile_split.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.producer_cost import _code_version, _machine

ROOT = Path(__file__).resolve().parent.parent

# (stage, frame substrings): a sample goes to the first stage one of whose substrings
# appears in one of its frames.
STAGES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "producers": [
        ("add_event: validate, serialise, ids, create span", ("prepare_rows",)),
        ("add_event: the INSERT (SQLAlchemy exec_driver_sql + psycopg)", ("exec_driver_sql",)),
        ("add_event: the rest (settings, backlog gate, session.connection)", ("add_events",)),
        (
            "the caller's transaction: begin, commit (SQLAlchemy + psycopg)",
            (
                "Session",
                "TransactionalContext",
                "_StateChange",
                "Engine.begin",
                "Engine.connect",
                "Connection.begin",
                "Connection.__init__",
                "Connection.close",
                "_ConnectionFairy",
                "commit",
            ),
        ),
        ("benchmark loop", ("produce", "closed_loop")),
    ],
    "workers": [
        ("handler (benchmark code: one INSERT)", ("_run_handler",)),
        ("inbox claim statement", ("_claim_all",)),
        ("metrics (prometheus_client)", ("record_processed", "prometheus_client")),
        ("tracing (process span)", ("process_span",)),
        ("envelope decoding (json)", ("decode_envelope",)),
        ("inbox transaction: session, begin, commit", ("InboxProcessor.handle",)),
        ("Dramatiq: fetch from Redis", ("ConsumerThread", "WakeableRedisConsumer")),
        ("Dramatiq: ack, middleware, dispatch", ("WorkerThread", "Broker.emit")),
    ],
    "relay": [
        ("claim statement", ("Drainer.claim",)),
        ("envelope encoding (json)", ("encode",)),
        ("Redis pipeline", ("_enqueue", "Pipeline.execute")),
        ("mark sent / outcomes", ("_settle", "_record_outcome")),
        ("rest of a batch", ("run_batch",)),
        ("loop, ledger sweep, janitor, metrics", ("Relay.", "Janitor", "ledger")),
        ("LISTEN thread", ("Listener",)),
    ],
}


def process_of(stack: str) -> str | None:
    """Which benchmark process a sample came from (by its command line in the stack)."""
    if "pipeline.tools.cli relay" in stack:
        return "relay"
    if "dramatiq pipeline.worker" in stack:
        return "workers"
    if "spawn_main" in stack and "produce" in stack:
        return "producers"
    return None


def stage_of(process: str, frames: Sequence[str]) -> str:
    if not frames:
        return "no Python frame (C code holding the GIL)"
    for stage, needles in STAGES[process]:
        if any(needle in frame for frame in frames for needle in needles):
            return stage
    return "other"


def split(lines: Iterable[str]) -> dict[str, Any]:
    """Samples per process and stage, from py-spy's ``raw`` (collapsed stack) output."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        stack, _, number = line.rstrip().rpartition(" ")
        if not number.isdigit() or "importlib" in stack:
            continue
        process = process_of(stack)
        if process is None:
            continue
        frames = [frame for frame in stack.split(";") if not frame.startswith("process ")]
        counts[process][stage_of(process, frames)] += int(number)
    result: dict[str, Any] = {}
    for process, stages in sorted(counts.items()):
        total = sum(stages.values())
        result[process] = {
            "samples": total,
            "share_pct": {
                stage: round(100 * count / total, 1) for stage, count in stages.most_common()
            },
        }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--api", choices=("core", "session"), default="core")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/profile_split.json"))
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("profile_split: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-profile-"))
    samples = workdir / "samples.txt"
    benchmark = [
        sys.executable,
        "-m",
        "benchmarks.end_to_end",
        "--only",
        "throughput",
        "--api",
        args.api,
        "--events-per-transaction",
        "1",
        "--observability",
        "default",
        "--duration",
        str(args.duration),
        "--output",
        str(workdir / "end_to_end.json"),
    ]
    command = [py_spy, "record", "--subprocesses", "--gil", "--nonblocking"]
    command += ["--rate", str(args.rate), "--format", "raw", "-o", str(samples), "--"]
    subprocess.run(command + benchmark, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    end_to_end = json.loads((workdir / "end_to_end.json").read_text())
    report = {
        "benchmark": "profile_split",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "benchmarks.profile_split", *sys.argv[1:]]),
        "machine": _machine(),
        "code": _code_version(),
        "method": (
            "py-spy --gil samples of an end_to_end closed-loop run (one event per "
            f"transaction, --api {args.api}, as shipped); shares of each process's samples"
        ),
        "cpu_ms_per_event_by_component_while_sampled": end_to_end["results"][
            "observability_default"
        ]["throughput"]["cpu_ms_per_event_by_component"],
        "split": split(samples.read_text().splitlines()),
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    for process, figures in report["split"].items():
        print(f"{process} ({figures['samples']} samples)")
        for stage, share in figures["share_pct"].items():
            print(f"  {share:5.1f} %  {stage}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
