"""CPU per span of the pipeline's ``create`` and ``process`` spans, by tracing set-up.

Each mode runs in a process of its own (a tracer provider is set once per process),
set up by ``configure_tracing`` from ``OTEL_*`` variables as a pipeline process is:

* ``off``     — ``OTEL_SDK_DISABLED=true``: no-op spans, no trace context stored;
* ``none``    — no exporter (the default): no provider installed, no-op spans; each
  event made outside a trace gets a new trace context of its own;
* ``otlp``    — the SDK's provider, every span recorded and exported by the official
  OTLP/HTTP exporter to a local sink;
* ``sampled`` — the same with ``parentbased_traceidratio`` at 0.1.

CPU is the process's own (threads included: the batch processor's export thread
encodes and posts the spans in its usual batches of 512), read with ``getrusage`` after
a flush; the processor's queue is made big enough that no span is dropped. The producer's
``create`` loop also formats the ``traceparent`` stored in the row; the ``process``
loop parses it back, as a worker does. The ``otlp`` and ``sampled`` figures are the
SDK's own cost per span, for comparing SDK releases. Writes
``benchmarks/results/span_cost.json``.

    .venv/bin/python -m benchmarks.span_cost [--spans 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from benchmarks import producer_cost as pc

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "none", "otlp", "sampled")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(mode: str, spans: int) -> dict[str, float]:
    from opentelemetry import trace

    from benchmarks.end_to_end import OtlpSink
    from pipeline.config import Settings
    from pipeline.envelope import ReceivedEvent
    from pipeline.observability import tracing

    sink = OtlpSink()
    if mode == "off":
        os.environ["OTEL_SDK_DISABLED"] = "true"
    elif mode in ("otlp", "sampled"):
        os.environ.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint)
        os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(2 * spans)
    if mode == "sampled":
        os.environ.update(
            OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0.1"
        )
    tracing.configure_tracing(Settings(), "span-cost")
    flush = getattr(trace.get_tracer_provider(), "force_flush", lambda: True)
    ids = [uuid.uuid4() for _ in range(spans)]
    # One span first: one-time set-up (lazy imports, the sampler) is not a per-span cost.
    tracing.start_create_span("warm.up", uuid.uuid4()).end()

    started = _cpu()
    headers = []
    for event_id in ids:
        span = tracing.start_create_span("order.placed", event_id, correlation_id="c-1")
        headers.append(tracing.span_headers(span))
        span.end()
    flush()
    create = (_cpu() - started) / spans

    events = [
        ReceivedEvent(
            id=event_id,
            type="order.placed",
            version=1,
            data={},
            source="span-cost",
            time="2026-01-01T00:00:00Z",
            seq=n,
            correlation_id="c-1",
            traceparent=header.get("traceparent"),
        )
        for n, (event_id, header) in enumerate(zip(ids, headers, strict=True))
    ]
    started = _cpu()
    for event in events:
        with tracing.process_span(event, "billing", 1):
            pass
    flush()
    process = (_cpu() - started) / spans
    tracing.shutdown_tracing()
    sink.shutdown()
    return {"create_us": round(create * 1e6, 2), "process_us": round(process * 1e6, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/span_cost.json"))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.spans)))
        return 0
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeat):  # modes interleaved, so a drift in speed hits all alike
        for mode in MODES:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.span_cost",
                    "--child",
                    mode,
                    "--spans",
                    str(args.spans),
                ],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=environment,
            ).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    medians: dict[str, Any] = {
        mode: {
            key: statistics.median(r[key] for r in results) for key in ("create_us", "process_us")
        }
        for mode, results in runs.items()
    }
    report = {
        "benchmark": "span_cost",
        "unit": "CPU microseconds per span (process CPU, export thread included)",
        "spans_per_run": args.spans,
        "machine": pc._machine(),
        "code": pc._code_version(),
        "median": medians,
        "runs": runs,
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(medians, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
