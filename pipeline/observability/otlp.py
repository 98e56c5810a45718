"""OTLP/HTTP span export with a hand-written protobuf encoder.

The official exporter builds a protobuf object tree per span and serialises it,
which costs more CPU than creating the span. :func:`encode_spans` writes the same
``ExportTraceServiceRequest`` wire bytes directly (field numbers from
opentelemetry-proto ``trace/v1``), following the official encoder's choices exactly:
spans grouped by resource then instrumentation scope, ``SpanFlags`` carrying only the
is-remote bits, links without their trace state, a ``status`` always present, and an
attribute whose value cannot be encoded dropped (with a log line) rather than failing
the batch.

:class:`OTLPHttpSpanExporter` posts those bytes with ``requests`` and reads the
standard ``OTEL_EXPORTER_OTLP_*`` variables.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import random
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import unquote

import requests
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, TraceState
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

log = logging.getLogger("pipeline.tracing.otlp")

# -- protobuf wire encoding -----------------------------------------------------------------

_U64: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_SMALL: Final = tuple(bytes((n,)) for n in range(128))  # one-byte varints, prebuilt
_IDS: Final = struct.Struct(">BBQQBBQ")  # trace_id (field 1) + span_id (field 2), big-endian
_TIMES: Final = struct.Struct("<BQBQ")  # start (field 7) + end (field 8), fixed64
_FIXED64: Final = struct.Struct("<Q")
_DOUBLE: Final = struct.Struct("<d")

# Span.kind (field 6): the OTLP enum is the SDK's value plus one.
_KINDS: Final = {kind: b"\x30" + _SMALL[kind.value + 1] for kind in SpanKind}
# SpanFlags: HAS_IS_REMOTE (0x100), plus IS_REMOTE (0x200) for a remote context.
_SPAN_FLAGS: Final = (
    b"\x85\x01" + struct.pack("<I", 0x100),
    b"\x85\x01" + struct.pack("<I", 0x300),
)
_LINK_FLAGS: Final = (b"\x35" + struct.pack("<I", 0x100), b"\x35" + struct.pack("<I", 0x300))
_EMPTY_STATUS: Final = b"\x7a\x00"
_BOOLS: Final = {False: b"\x12\x02\x10\x00", True: b"\x12\x02\x10\x01"}  # KeyValue.value

# Encoded ``KeyValue.key`` fields, shared across batches: attribute keys repeat endlessly.
_KEY_CACHE_LIMIT: Final = 4096
_keys: dict[str, bytes] = {}


def _varint(n: int) -> bytes:
    """Base-128 varint of a non-negative integer (two-byte values get a fast path)."""
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes or embedded message)."""
    return b"".join((tag, _varint(len(payload)), payload))


def _key(key: str) -> bytes:
    """The ``KeyValue.key`` field for ``key``, cached (bounded: keys may be dynamic)."""
    encoded = _keys.get(key)
    if encoded is None:
        if len(_keys) >= _KEY_CACHE_LIMIT:
            _keys.clear()
        encoded = _keys[key] = _field(b"\x0a", key.encode())
    return encoded


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` message body; type checks in the official encoder's order.

    Oneof members are always written, even when zero or empty, as protobuf does.
    Raises for a type OTLP cannot carry or an int outside int64.
    """
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, int):
        if not _I64_MIN <= value <= _I64_MAX:
            raise ValueError("integer attribute out of int64 range")
        return b"\x18" + _varint(value & _U64)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        items = b"".join([_field(b"\x0a", _any_value(item)) for item in value])
        return _field(b"\x2a", items)
    if isinstance(value, Mapping):
        pairs = b"".join([_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items()])
        return _field(b"\x32", pairs)
    raise TypeError(f"unsupported attribute type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue`` message body (the value message is always present)."""
    return _key(key) + _field(b"\x12", _any_value(value))


def _dropped(item: Any) -> int:
    """How many attributes the SDK dropped from an event or link (0 for plain objects)."""
    return int(getattr(item, "dropped_attributes", 0) or 0)


def _attributes(tag: bytes, attributes: Any) -> bytes:
    """Repeated ``KeyValue`` fields from a mapping; one that cannot be encoded is skipped.

    Scalars whose whole ``KeyValue`` fits in 127 bytes, most attributes, are written
    inline (one-byte lengths) without helper calls.
    """
    parts: list[bytes] = []
    extend = parts.extend
    keys = _keys
    for key, value in attributes.items():
        try:
            prefix = keys.get(key) or _key(key)
            if len(prefix) < 0x70:
                kind = type(value)
                if kind is str:
                    data = value.encode()
                    n = len(data)
                    size = len(prefix) + n + 4
                    if size < 0x80:
                        extend(
                            (
                                tag,
                                _SMALL[size],
                                prefix,
                                b"\x12",
                                _SMALL[n + 2],
                                b"\x0a",
                                _SMALL[n],
                                data,
                            )
                        )
                        continue
                elif kind is int and 0 <= value < 0x80:
                    extend((tag, _SMALL[len(prefix) + 4], prefix, b"\x12\x02\x18", _SMALL[value]))
                    continue
                elif kind is bool:
                    extend((tag, _SMALL[len(prefix) + 4], prefix, _BOOLS[value]))
                    continue
                elif kind is float:
                    extend(
                        (
                            tag,
                            _SMALL[len(prefix) + 11],
                            prefix,
                            b"\x12\x09\x21",
                            _DOUBLE.pack(value),
                        )
                    )
                    continue
            pair = prefix + _field(b"\x12", _any_value(value))
        except Exception as exc:  # the official encoder drops the attribute, not the batch
            log.warning("OTLP: attribute %r not encoded (%s)", key, type(exc).__name__)
            continue
        extend((tag, _varint(len(pair)), pair))
    return b"".join(parts)


def _trace_state(trace_state: TraceState | None) -> bytes:
    if not trace_state:
        return b""
    return _field(b"\x1a", ",".join([f"{k}={v}" for k, v in trace_state.items()]).encode())


def _status(status: Status | None) -> bytes:
    """``Status`` (field 15): present whenever the span has one, as officially encoded."""
    if status is None:
        return b""
    code = status.status_code.value
    description = status.description
    if not code and not description:
        return _EMPTY_STATUS
    body = _field(b"\x12", description.encode()) if description else b""
    if code:
        body += b"\x18" + _varint(code)
    return _field(b"\x7a", body)


def _events(events: Any) -> bytes:
    parts: list[bytes] = []
    for event in events:
        name, timestamp = event.name, event.timestamp
        plain, dropped = event.attributes, _dropped(event)
        body = b"".join(
            (
                b"\x09" + _FIXED64.pack(timestamp) if timestamp else b"",
                _field(b"\x12", name.encode()) if name else b"",
                _attributes(b"\x1a", plain) if plain else b"",
                b"\x20" + _varint(dropped) if dropped else b"",
            )
        )
        parts.append(_field(b"\x5a", body))
    return b"".join(parts)


def _links(links: Any) -> bytes:
    """Link fields (13); like the official encoder, without the link's trace state."""
    parts: list[bytes] = []
    extend = parts.extend
    pack = _IDS.pack
    for link in links:
        trace_id, span_id, remote, _, _, _ = link.context
        plain, dropped = link.attributes, _dropped(link)
        body = pack(0x0A, 16, trace_id >> 64, trace_id & _U64, 0x12, 8, span_id)
        if plain:
            body += _attributes(b"\x22", plain)
        if dropped:
            body += b"\x28" + _varint(dropped)
        body += _LINK_FLAGS[1 if remote else 0]
        extend((b"\x6a", _varint(len(body)), body))
    return b"".join(parts)


def _times(start: int | None, end: int | None) -> bytes:
    """``start_time_unix_nano`` (7) and ``end_time_unix_nano`` (8), fixed64, if set."""
    if start and end:
        return _TIMES.pack(0x39, start, 0x41, end)
    return (b"\x39" + _FIXED64.pack(start) if start else b"") + (
        b"\x41" + _FIXED64.pack(end) if end else b""
    )


def _span(span: ReadableSpan) -> bytes:
    """A ``Span`` message body, fields in number order (as protobuf writes them).

    Only the public ``ReadableSpan`` API is used (its properties copy events and links,
    ~2 µs a span, a price worth not breaking on an SDK upgrade).
    """
    context, parent = span.context, span.parent
    if context is None:
        raise ValueError("span without a context")
    trace_id, span_id, _, _, trace_state, _ = context
    name, start, end, status = span.name, span.start_time, span.end_time, span.status
    plain, dropped_attributes = span.attributes, span.dropped_attributes
    events, dropped_events = span.events, span.dropped_events
    links, dropped_links = span.links, span.dropped_links
    return b"".join(
        (
            _IDS.pack(0x0A, 16, trace_id >> 64, trace_id & _U64, 0x12, 8, span_id),
            b"" if trace_state is DEFAULT_TRACE_STATE else _trace_state(trace_state),
            b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
            _field(b"\x2a", name.encode()) if name else b"",
            _KINDS[span.kind],
            _TIMES.pack(0x39, start, 0x41, end) if start and end else _times(start, end),
            _attributes(b"\x4a", plain) if plain else b"",
            b"\x50" + _varint(dropped_attributes) if dropped_attributes else b"",
            _events(events) if events else b"",
            b"\x60" + _varint(dropped_events) if dropped_events else b"",
            _links(links) if links else b"",
            b"\x70" + _varint(dropped_links) if dropped_links else b"",
            _EMPTY_STATUS
            if status is not None and status.is_unset and not status.description
            else _status(status),
            _SPAN_FLAGS[1 if parent is not None and parent.is_remote else 0],
        )
    )


def _scope(scope: InstrumentationScope | None) -> bytes:
    """``InstrumentationScope`` message body (empty for a span without a scope)."""
    if scope is None:
        return b""
    return b"".join(
        (
            _field(b"\x0a", scope.name.encode()) if scope.name else b"",
            _field(b"\x12", scope.version.encode()) if scope.version else b"",
            _optional_attributes(b"\x1a", scope.attributes),
        )
    )


def _optional_attributes(tag: bytes, attributes: Any) -> bytes:
    """:func:`_attributes` for any attributes value, ``None`` included (off the hot path)."""
    plain = attributes
    return _attributes(tag, plain) if plain else b""


_Scopes = dict[InstrumentationScope | None, list[bytes]]


def _group(spans: Sequence[ReadableSpan]) -> dict[Resource, _Scopes]:
    """Encoded spans by resource, then scope, in first-seen order (as officially grouped).

    Grouping uses equality like the official encoder, but ``Resource.__hash__``
    serialises all attributes to JSON, so each distinct pair of objects is looked
    up once per batch and remembered by identity (the spans keep them alive).
    """
    grouped: dict[Resource, _Scopes] = {}
    by_identity: dict[tuple[int, int], list[bytes]] = {}
    last_resource: Resource | None = None
    last_scope: InstrumentationScope | None = None
    bucket: list[bytes] | None = None
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        if bucket is None or resource is not last_resource or scope is not last_scope:
            ids = (id(resource), id(scope))
            found = by_identity.get(ids)
            if found is None:
                found = by_identity[ids] = grouped.setdefault(resource, {}).setdefault(scope, [])
            bucket, last_resource, last_scope = found, resource, scope
        body = _span(span)
        bucket.extend((b"\x12", _varint(len(body)), body))
    return grouped


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """The serialised ``ExportTraceServiceRequest`` for ``spans``.

    Parses to a message equal to the official
    ``trace_encoder.encode_spans(spans)``, at a fraction of its cost.
    """
    resource_spans: list[bytes] = []
    for resource, scopes in _group(spans).items():
        body = [_field(b"\x0a", _optional_attributes(b"\x0a", resource.attributes))]
        for scope, encoded in scopes.items():
            scope_spans = [_field(b"\x0a", _scope(scope)), *encoded]
            if scope is not None and scope.schema_url:
                scope_spans.append(_field(b"\x1a", scope.schema_url.encode()))
            body.append(_field(b"\x12", b"".join(scope_spans)))
        if resource.schema_url:
            body.append(_field(b"\x1a", resource.schema_url.encode()))
        resource_spans.append(_field(b"\x0a", b"".join(body)))
    return b"".join(resource_spans)


# -- HTTP export ----------------------------------------------------------------------------

DEFAULT_ENDPOINT: Final = "http://localhost:4318"
DEFAULT_TIMEOUT: Final = 10.0
RETRYABLE_STATUS: Final = frozenset({429, 502, 503, 504})
_USER_AGENT: Final = "outbox-pipeline-otlp-exporter"


def _env(name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>`` (unset if empty)."""
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")
        or None
    )


def _endpoint_from_env() -> str:
    """The traces URL: the signal-specific variable as-is, else the base plus ``/v1/traces``."""
    if endpoint := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return endpoint
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_ENDPOINT
    return f"{base.removesuffix('/')}/v1/traces"


def parse_headers(raw: str) -> dict[str, str]:
    """``key=value`` pairs separated by commas, URL-decoded; names lower-cased.

    Malformed entries are skipped with a warning that names neither the entry nor
    its value: header values are usually credentials.
    """
    headers: dict[str, str] = {}
    for position, item in enumerate(raw.split(","), start=1):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = unquote(key).strip().lower()
        if not sep or not key:
            log.warning("OTLP headers: entry %d is not key=value, ignored", position)
            continue
        headers[key] = unquote(value).strip()
    return headers


def _timeout_from_env() -> float:
    raw = _env("TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        return float(raw)
    except ValueError:
        log.warning("OTLP timeout %r is not a number; using %ss", raw, DEFAULT_TIMEOUT)
        return DEFAULT_TIMEOUT


def _gzip_from_env() -> bool:
    value = (_env("COMPRESSION") or "none").strip().lower()
    if value not in {"gzip", "none"}:
        log.warning("OTLP compression %r is not supported; sending uncompressed", value)
    return value == "gzip"


def _retry_after(response: Any) -> float | None:
    """A ``Retry-After`` given in seconds (the HTTP-date form is rare for collectors)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return max(seconds, 0.0) if math.isfinite(seconds) else None


class OTLPHttpSpanExporter(SpanExporter):
    """OTLP over HTTP/protobuf, encoding with :func:`encode_spans`.

    Arguments override the ``OTEL_EXPORTER_OTLP_*`` variables the official HTTP
    exporter reads (``ENDPOINT``, ``HEADERS``, ``TIMEOUT``, ``COMPRESSION``,
    ``CERTIFICATE``, ``CLIENT_CERTIFICATE``, ``CLIENT_KEY``; each also in its
    ``TRACES_`` form, which wins). Responses 429/502/503/504 and connection errors
    are retried with exponential backoff (``backoff`` seconds first, jittered, or the
    collector's ``Retry-After``) while the timeout allows. Nothing from the spans or
    the headers is ever logged.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        compression: str | None = None,
        certificate_file: str | None = None,
        client_certificate_file: str | None = None,
        client_key_file: str | None = None,
        session: requests.Session | None = None,
        backoff: float = 1.0,
    ) -> None:
        self._endpoint = endpoint or _endpoint_from_env()
        self._timeout = timeout if timeout is not None else _timeout_from_env()
        self._gzip = compression == "gzip" if compression is not None else _gzip_from_env()
        self._headers = {
            "content-type": "application/x-protobuf",
            "user-agent": _USER_AGENT,
            **parse_headers(_env("HEADERS") or ""),
            **{key.lower(): value for key, value in (headers or {}).items()},
        }
        if self._gzip:
            self._headers["content-encoding"] = "gzip"
        self._backoff = backoff
        self._session = session if session is not None else requests.Session()
        self._session.verify = certificate_file or _env("CERTIFICATE") or True
        client_cert = client_certificate_file or _env("CLIENT_CERTIFICATE")
        client_key = client_key_file or _env("CLIENT_KEY")
        if client_cert:
            self._session.cert = (client_cert, client_key) if client_key else client_cert
        self._stopped = threading.Event()

    @property
    def endpoint(self) -> str:
        """The traces URL requests go to."""
        return self._endpoint

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._stopped.is_set():
            log.warning("OTLP export after shutdown: %d spans dropped", len(spans))
            return SpanExportResult.FAILURE
        try:
            body = encode_spans(spans)
        except Exception as exc:
            log.warning("OTLP export: %d spans not encoded (%s)", len(spans), type(exc).__name__)
            return SpanExportResult.FAILURE
        if self._gzip:
            body = gzip.compress(body, compresslevel=6)
        failure = self._post(body)
        if failure is None:
            return SpanExportResult.SUCCESS
        log.warning("OTLP export failed: %s; %d spans dropped", failure, len(spans))
        return SpanExportResult.FAILURE

    def _post(self, body: bytes) -> str | None:
        """POST until success, a permanent failure, the deadline or shutdown.

        Returns ``None`` on success, else what went wrong (a status code or an
        exception class, never a message: it may echo the request).
        """
        deadline = time.monotonic() + self._timeout
        delay = self._backoff
        first = True
        while True:
            remaining = deadline - time.monotonic()
            wait: float | None
            try:
                response = self._session.post(
                    self._endpoint, data=body, headers=self._headers, timeout=max(remaining, 0.001)
                )
            except requests.ConnectionError as exc:  # includes connect timeouts
                # The first may be a pooled connection the collector closed: retry at once.
                failure, wait = type(exc).__name__, 0.0 if first else None
            except requests.RequestException as exc:
                return type(exc).__name__
            else:
                if 200 <= response.status_code < 300:
                    return None
                failure = f"HTTP {response.status_code}"
                if response.status_code not in RETRYABLE_STATUS:
                    return failure
                wait = _retry_after(response)
            first = False
            if wait is None:
                wait = delay * random.uniform(0.8, 1.2)
                delay *= 2
            if wait > deadline - time.monotonic():
                return f"{failure} (gave up at the {self._timeout:g}s timeout)"
            if self._stopped.wait(wait):
                return f"{failure} (shut down while retrying)"

    def shutdown(self) -> None:
        """Stop exporting: later batches fail at once and a pending retry is abandoned."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._session.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here (the span processor batches)."""
        return True
