"""The SDK's samplers the span tests run under, by name.

Ratio 0.5: a trace id is sampled when its low 64 bits are below half their range, so the
tests' trace ids choose either side.
"""

from __future__ import annotations

from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

BUILT_IN_SAMPLERS: dict[str, Sampler] = {
    "parentbased_always_on": ParentBased(ALWAYS_ON),  # the SDK's default
    "traceidratio": TraceIdRatioBased(0.5),
    "parentbased_traceidratio": ParentBased(TraceIdRatioBased(0.5)),
    "always_off": ALWAYS_OFF,
}
