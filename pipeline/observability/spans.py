"""The pipeline's own spans, made without the SDK's ``start_span`` under the pipeline's provider.

Every event gets a ``create`` and a ``process`` span, so their cost is tracing's cost.
The SDK's ``Tracer.start_span`` and ``end`` spend most of theirs validating and copying
attributes the pipeline built itself and snapshotting the span for its processors.
Under :class:`PipelineTracerProvider` (what ``configure_tracing`` installs)
:class:`SpanFactory` makes the same spans for less: an exported ``create`` span costs
23.5 µs of CPU all told instead of 37.6 (``benchmarks/span_cost.py``). The same
ids, flags and trace state, the provider's sampler's decision (asked as the SDK asks it;
the SDK's own samplers, being pure, are decided without the call), the same attributes,
events, links, status and span limits, and the same calls to the provider's span
processors, which receive the span itself (an SDK ``ReadableSpan`` that refuses
changes once ended) instead of a copy. tests/unit/test_recorded_spans.py compares the
two field by field.

Not reproduced: the SDK's own span metrics (``otel.sdk.span.*``, recorded only with an
OpenTelemetry meter provider) and its experimental per-tracer configurator, which
``configure_tracing`` never sets. An application's own SDK provider keeps the SDK's
spans.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.environment_variables import OTEL_SDK_DISABLED
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    SynchronousMultiSpanProcessor,
    TracerProvider,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationInfo, InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util import types

log = logging.getLogger("opentelemetry.sdk.trace")  # the SDK's own warnings, same logger

SCOPE_NAME = "pipeline"
_PLAIN_VALUES = frozenset({str, bool, int, float})  # validated as they are (no length limit)
# The decisions, compared by identity: ``Decision.is_recording()`` costs more than a span id.
_SAMPLED = Decision.RECORD_AND_SAMPLE
_RECORDED_ONLY = Decision.RECORD_ONLY
_DROP = Decision.DROP
_RANDOM_FLAG = trace.TraceFlags.RANDOM_TRACE_ID  # W3C trace-context level 2


def _sdk_samplers(base: type[Sampler]) -> frozenset[type[Sampler]]:
    """``base`` and the SDK's own subclasses that keep its ``should_sample``.

    These (the ``OTEL_TRACES_SAMPLER`` choices) are pure functions of the parent and the
    trace id, so :func:`_builtin_decision` decides for them without a call, and without
    the attributes and links a span that is not recorded never needs. Any other sampler,
    a subclass of these included, is called as the SDK calls it.
    """
    return frozenset(
        kind
        for kind in (base, *base.__subclasses__())
        if kind.__module__ == base.__module__ and kind.should_sample is base.should_sample
    )


_PARENT_BASED = _sdk_samplers(ParentBased)
_STATIC = _sdk_samplers(StaticSampler)
_RATIO_LIMIT = TraceIdRatioBased.TRACE_ID_LIMIT
# ParentBased's delegate for a valid parent, by (is remote, is sampled).
_PARENT_DELEGATES = {
    (True, True): "_remote_parent_sampled",
    (True, False): "_remote_parent_not_sampled",
    (False, True): "_local_parent_sampled",
    (False, False): "_local_parent_not_sampled",
}

Attributes = Mapping[str, types.AttributeValue]


class PipelineTracerProvider(TracerProvider):
    """The SDK's provider, whose pipeline spans its :class:`SpanFactory` makes.

    ``pipeline_spans`` is ``None`` when ``OTEL_SDK_DISABLED`` is true: the SDK's tracers
    are then no-ops, and so are the pipeline's spans. Its processors are the ones added
    with ``add_span_processor`` (called in order, as the SDK's default processor does).
    """

    def __init__(
        self,
        sampler: Sampler | None = None,
        resource: Resource | None = None,
        shutdown_on_exit: bool = True,
        active_span_processor: None = None,
        id_generator: IdGenerator | None = None,
        span_limits: SpanLimits | None = None,
    ) -> None:
        if active_span_processor is not None:
            raise TypeError("PipelineTracerProvider takes its processors from add_span_processor")
        limits = span_limits if span_limits is not None else SpanLimits()
        super().__init__(sampler, resource, shutdown_on_exit, None, id_generator, limits)
        disabled = os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true"
        self.pipeline_spans = None if disabled else SpanFactory(self, limits)

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        if self.pipeline_spans is not None:
            self.pipeline_spans.add_processor(span_processor)


class SpanFactory:
    """Starts the pipeline's spans for one provider: recorded once a processor reads them."""

    def __init__(self, provider: TracerProvider, limits: SpanLimits) -> None:
        self.provider = provider
        self.limits = limits
        self.scope = InstrumentationScope(SCOPE_NAME, "")  # as the SDK names an unversioned tracer
        with warnings.catch_warnings():  # deprecated, but the SDK's spans still carry it
            warnings.simplefilter("ignore", DeprecationWarning)
            self.info = InstrumentationInfo(SCOPE_NAME, "")
        self.processor = SynchronousMultiSpanProcessor()  # type: ignore[no-untyped-call]
        self.recording = False  # until a processor is added nothing would read a span

    def add_processor(self, processor: SpanProcessor) -> None:
        self.processor.add_span_processor(processor)
        self.recording = True

    def start(
        self,
        name: str,
        kind: SpanKind,
        parent: otel_context.Context | None,
        attributes: Attributes | Callable[[], Attributes],
        links: Sequence[Link] | Callable[[], Sequence[Link]] = (),
        *,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        """What the SDK's ``Tracer.start_span`` would return for these arguments.

        ``parent`` ``None`` means the current context, as in the SDK. The span is
        recorded when a processor is installed and the sampler says so; otherwise it is
        a ``NonRecordingSpan`` with the ids, flags and trace state the SDK would give it.
        ``attributes`` and ``links`` may be functions that make them: they are called
        only when the sampler or the recorded span needs them.
        """
        provider = self.provider
        ids = provider.id_generator
        parent_span = trace.get_current_span(parent).get_span_context()
        root = not parent_span.is_valid
        trace_id = ids.generate_trace_id() if root else parent_span.trace_id
        decision = _builtin_decision(provider.sampler, parent_span, trace_id)
        if decision is None:  # another sampler: asked exactly as the SDK asks it
            if callable(attributes):
                attributes = attributes()
            links = _made(links)  # the sampler has seen them: no longer the span's alone
            sampled = provider.sampler.should_sample(
                parent, trace_id, name, kind, attributes, links
            )
            decision, trace_state = sampled.decision, sampled.trace_state
            attributes = sampled.attributes
        else:  # a built-in sampler keeps the parent's trace state and the attributes
            trace_state = None if root else parent_span.trace_state
        flags = trace.TraceFlags.SAMPLED if decision is _SAMPLED else trace.TraceFlags.DEFAULT
        if ids.is_trace_id_random() if root else parent_span.trace_flags.random_trace_id:
            flags |= _RANDOM_FLAG
        context = trace.SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=trace.TraceFlags(flags),
            trace_state=trace_state,
        )
        if not self.recording or (decision is not _SAMPLED and decision is not _RECORDED_ONLY):
            return trace.NonRecordingSpan(context)
        span = RecordedSpan(
            self,
            name,
            context,
            None if root else parent_span,
            kind,
            attributes() if callable(attributes) else attributes,
            _made(links),
            owned_links=callable(links),
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        )
        # Processors get the span the SDK's would: the API's Span plus ReadableSpan.
        self.processor.on_start(span, parent_context=parent)  # type: ignore[arg-type]
        return span


def _made(links: Sequence[Link] | Callable[[], Sequence[Link]]) -> Sequence[Link]:
    """The links, made now if given as a function; ``()`` for none, as the SDK passes them."""
    return (links() if callable(links) else links) or ()


def _builtin_decision(
    sampler: Sampler, parent: trace.SpanContext, trace_id: int
) -> Decision | None:
    """The decision one of the SDK's own samplers would make; ``None`` for any other."""
    kind = type(sampler)
    if kind in _PARENT_BASED:
        delegate: Any = vars(sampler)
        if "should_sample" in delegate:  # replaced on the object (a test's patch): call it
            return None
        chosen = (
            _PARENT_DELEGATES[parent.is_remote, parent.trace_flags.sampled]
            if parent.is_valid
            else "_root"
        )
        sampler = delegate.get(chosen)
        kind = type(sampler)
    if "should_sample" in getattr(sampler, "__dict__", {}):
        return None
    if kind in _STATIC:
        decision: Decision | None = getattr(sampler, "_decision", None)
        return decision
    if kind is TraceIdRatioBased:
        bound = getattr(sampler, "bound", None)
        if bound is not None:
            return _SAMPLED if trace_id & _RATIO_LIMIT < bound else _DROP
    return None


class RecordedSpan(trace.Span, ReadableSpan):
    """A recording span: the API's ``Span`` over the SDK's ``ReadableSpan`` fields.

    Mutations follow the SDK's span: span limits apply, an ended span refuses changes
    with the SDK's warning, status ``OK`` is final. Attributes stay a plain dict while
    they are plain values within the limits, as the SDK would keep them unchanged.
    """

    def __init__(
        self,
        factory: SpanFactory,
        name: str,
        context: trace.SpanContext,
        parent: trace.SpanContext | None,
        kind: SpanKind,
        attributes: Mapping[str, types.AttributeValue],
        links: Sequence[Link],
        *,
        owned_links: bool = False,
        record_exception: bool,
        set_status_on_exception: bool,
    ) -> None:
        limits = factory.limits
        ReadableSpan.__init__(
            self,
            name=name,
            context=context,
            parent=parent,
            resource=factory.provider.resource,
            attributes=_kept(
                attributes,
                limits.max_span_attributes,
                limits.max_span_attribute_length,
                immutable=False,
            ),
            links=_span_links(links, limits, owned=owned_links),
            kind=kind,
            instrumentation_info=factory.info,
            instrumentation_scope=factory.scope,
            start_time=time_ns(),
        )
        self._factory = factory
        self._lock = threading.Lock()
        self._record_exception = record_exception
        self._set_status_on_exception = set_status_on_exception

    def get_span_context(self) -> trace.SpanContext:
        return self._context  # type: ignore[return-value]

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        with self._lock:
            if self._end_time is not None:
                log.warning("Setting attribute on ended span.")
                return
            self._bounded_attributes()[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        with self._lock:
            if self._end_time is not None:
                log.warning("Setting attribute on ended span.")
                return
            bounded = self._bounded_attributes()
            set_items = getattr(bounded, "_set_items", None)  # the SDK's batch set, if any
            if set_items is not None:
                set_items(attributes)
                return
            for key, value in attributes.items():
                bounded[key] = value

    def _bounded_attributes(self) -> BoundedAttributes:
        """The attributes under the SDK's limits, from the first change made after start."""
        if not isinstance(self._attributes, BoundedAttributes):
            limits = self._factory.limits
            self._attributes = BoundedAttributes(
                limits.max_span_attributes,
                self._attributes,
                immutable=False,
                max_value_len=limits.max_span_attribute_length,
            )
        return self._attributes

    def add_event(
        self, name: str, attributes: types.Attributes = None, timestamp: int | None = None
    ) -> None:
        limits = self._factory.limits
        event = Event(
            name,
            BoundedAttributes(
                limits.max_event_attributes,
                attributes,
                max_value_len=limits.max_attribute_length,
                immutable=True,
            ),
            timestamp,
        )
        with self._lock:
            ended = self._end_time is not None
            if not ended:
                if not isinstance(self._events, BoundedList):
                    self._events = BoundedList(limits.max_events)
                self._events.append(event)
        self._warn_if_ended(ended, "_add_event")

    def add_link(self, context: trace.SpanContext, attributes: types.Attributes = None) -> None:
        if not _valid_link(context, attributes):
            return
        limits = self._factory.limits
        link = Link(context, _link_attributes(attributes, limits))
        with self._lock:
            ended = self._end_time is not None
            if not ended:
                if not isinstance(self._links, BoundedList):
                    self._links = BoundedList.from_seq(limits.max_links, self._links)
                self._links.append(link)
        self._warn_if_ended(ended, "_add_link")

    def update_name(self, name: str) -> None:
        with self._lock:
            ended = self._end_time is not None
            if not ended:
                self._name = name
        self._warn_if_ended(ended, "update_name")

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        with self._lock:
            ended = self._end_time is not None
            if not ended:
                self._set_status(status, description)
        self._warn_if_ended(ended, "set_status")

    def _set_status(self, status: Status | StatusCode, description: str | None) -> None:
        if self._status.status_code is StatusCode.OK:  # OK is final
            return
        if isinstance(status, Status):
            if status.status_code is StatusCode.UNSET:
                return
            if description is not None:
                log.warning(
                    "Description %s ignored. Use either `Status` or `(StatusCode, Description)`",
                    description,
                )
            self._status = status
        elif isinstance(status, StatusCode) and status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        kind = type(exception)
        module, qualname = kind.__module__, kind.__qualname__
        event: dict[str, types.AttributeValue] = {
            "exception.type": f"{module}.{qualname}"
            if module and module != "builtins"
            else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        with self._lock:
            if self._end_time is not None:
                log.warning("Calling end() on an ended span.")
                return
            self._end_time = end_time if end_time is not None else time_ns()
        processor = self._factory.processor
        on_ending = getattr(processor, "_on_ending", None)  # the SDK's (private) OnEnding hook
        if on_ending is not None:
            on_ending(self)
        processor.on_end(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        if exc_val is not None and self.is_recording():
            if self._record_exception:
                self.record_exception(exc_val, escaped=True)
            if self._set_status_on_exception:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        super().__exit__(exc_type, exc_val, exc_tb)

    @staticmethod
    def _warn_if_ended(ended: bool, method: str) -> None:
        """The SDK's warning for a change to an ended span (logged outside the lock)."""
        if ended:
            log.warning("Tried calling %s on an ended span.", method)

    def __repr__(self) -> str:
        return f'{type(self).__name__}(name="{self._name}", context={self._context})'


def _plain(attributes: Mapping[str, Any], max_count: int | None) -> bool:
    """Attributes the SDK's validation would keep exactly as they are."""
    if max_count is not None and len(attributes) > max_count:
        return False
    for key, value in attributes.items():  # a loop: all() over a generator costs more here
        if type(value) not in _PLAIN_VALUES or type(key) is not str or not key:
            return False
    return True


def _kept(
    attributes: Mapping[str, types.AttributeValue],
    max_count: int | None,
    max_length: int | None,
    *,
    immutable: bool,
) -> Mapping[str, types.AttributeValue]:
    """Attributes as the SDK keeps them: a plain copy while plain and within the limits."""
    if max_length is None and _plain(attributes, max_count):
        return dict(attributes)
    return BoundedAttributes(max_count, attributes, immutable=immutable, max_value_len=max_length)


def _valid_link(context: trace.SpanContext | None, attributes: types.Attributes) -> bool:
    """The SDK's rule: a link needs a valid context, or attributes or a trace state."""
    return bool(context and (context.is_valid or (attributes or context.trace_state)))


def _link_attributes(attributes: types.Attributes, limits: SpanLimits) -> types.Attributes:
    return _kept(
        attributes or {}, limits.max_link_attributes, limits.max_attribute_length, immutable=True
    )


def _span_links(links: Sequence[Link], limits: SpanLimits, *, owned: bool) -> Sequence[Link]:
    """The links the SDK would keep, with its limits applied (the caller's are not changed).

    ``owned`` links were made for this span alone (by a links function): one whose
    attributes the limits keep as they are is kept itself rather than copied.
    """
    kept: list[Link] = []
    as_they_are = owned and limits.max_attribute_length is None
    for link in links:
        if link and _valid_link(link.context, link.attributes):
            attributes = link.attributes
            if (
                as_they_are
                and type(attributes) is dict
                and _plain(attributes, limits.max_link_attributes)
            ):
                kept.append(link)
            else:
                kept.append(Link(link.context, _link_attributes(attributes, limits)))
    if limits.max_links is not None and len(kept) > limits.max_links:
        return BoundedList.from_seq(limits.max_links, kept)
    return kept
