"""OpenTelemetry traces: one trace per task, from its submission through each attempt's
claim, run and report, and one per workflow run, whose node releases link to their tasks.

Off unless the standard environment asks for it: ``OTEL_TRACES_EXPORTER=otlp`` (or
``console``), or an ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``;
``OTEL_SDK_DISABLED=true`` wins over both. The OTLP exporter (HTTP/protobuf) then reads the
rest of ``OTEL_EXPORTER_OTLP_*`` and the resource ``OTEL_SERVICE_NAME`` /
``OTEL_RESOURCE_ATTRIBUTES`` itself. While off, every helper here is a no-op.

A task's trace needs no storage: its trace id and root span id are digests of the task's id
and creation time, which every core replica can compute, so the submit span is the root and
the claim spans are its children wherever they happen. The claim hands the worker a W3C
``traceparent``; the worker's run span is its child, and the report request carries the run
span's context in its headers (``CoreClient`` injects the current context). A workflow run's
trace is made the same way from the run's id and creation time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags

Attributes = Mapping[str, str | int | float | bool]

_provider: TracerProvider | None = None
# The ids a root span must take (trace id, span id), while it is being started.
_forced: ContextVar[tuple[int, int] | None] = ContextVar("cairn_forced_ids", default=None)


class _DerivedIds(RandomIdGenerator):
    """Random ids, except for the root span of a task's or a run's trace."""

    def generate_trace_id(self) -> int:
        forced = _forced.get()
        return forced[0] if forced else super().generate_trace_id()

    def generate_span_id(self) -> int:
        forced = _forced.get()
        return forced[1] if forced else super().generate_span_id()


def _asked() -> SpanExporter | None:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if choice == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if choice == "otlp" or (choice == "" and endpoint):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    return None


def setup(service: str, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Trace this process if the environment (or a test, with ``exporter``) asks for it.
    The first call wins: services sharing a test process share one provider."""
    global _provider
    if _provider is not None:
        return _provider
    exporter = exporter or _asked()
    if exporter is None:
        return None
    name = os.environ.get("OTEL_SERVICE_NAME") or f"cairn-{service}"
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}), id_generator=_DerivedIds()
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    return provider


def shutdown() -> None:
    """Flush and stop tracing (tests; a process's exit flushes by itself)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def enabled() -> bool:
    return _provider is not None


def _tracer(service: str) -> trace.Tracer:
    assert _provider is not None
    return _provider.get_tracer(f"cairn.{service}")


def _derived(kind: str, ident: int, created_at: datetime) -> SpanContext:
    stamp = created_at.astimezone(UTC).isoformat()
    digest = hashlib.sha256(f"cairn-{kind}:{ident}:{stamp}".encode()).digest()
    return SpanContext(
        trace_id=int.from_bytes(digest[:16], "big") or 1,
        span_id=int.from_bytes(digest[16:24], "big") or 1,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )


def task_context(task_id: int, created_at: datetime) -> SpanContext:
    """The context of a task's root span (its submission)."""
    return _derived("task", task_id, created_at)


def run_context(run_id: int, created_at: datetime) -> SpanContext:
    """The context of a workflow run's root span (its creation)."""
    return _derived("run", run_id, created_at)


def traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _remote(parent: SpanContext) -> Context:
    return trace.set_span_in_context(NonRecordingSpan(parent))


def incoming(headers: Mapping[str, str]) -> SpanContext | None:
    """The span context a request's ``traceparent`` header names, if any."""
    found = trace.get_current_span(propagate.extract(headers)).get_span_context()
    return found if found.is_valid else None


def from_traceparent(value: str | None) -> SpanContext | None:
    return incoming({"traceparent": value}) if value else None


def root(
    service: str,
    name: str,
    context: SpanContext,
    attributes: Attributes,
    *,
    start_ns: int | None = None,
    links: list[SpanContext | None] | None = None,
) -> None:
    """Record the root span of a task's or a run's trace, with the ids ``context`` has."""
    if _provider is None:
        return
    token = _forced.set((context.trace_id, context.span_id))
    try:
        span = _tracer(service).start_span(
            name,
            context=Context(),
            attributes=dict(attributes),
            start_time=start_ns,
            links=[Link(c) for c in links or [] if c is not None],
        )
    finally:
        _forced.reset(token)
    span.end()


def child(
    service: str,
    name: str,
    parent: SpanContext | None,
    attributes: Attributes,
    *,
    start_ns: int | None = None,
    links: list[SpanContext | None] | None = None,
) -> str | None:
    """Record a finished span under ``parent``; return its ``traceparent``."""
    if _provider is None or parent is None:
        return None
    span = _tracer(service).start_span(
        name,
        context=_remote(parent),
        attributes=dict(attributes),
        start_time=start_ns,
        links=[Link(c) for c in links or [] if c is not None],
    )
    span.end()
    return traceparent(span.get_span_context())


@contextlib.contextmanager
def span(
    service: str, name: str, parent: SpanContext | None, attributes: Attributes
) -> Iterator[Any]:
    """A span under ``parent`` around a block, current inside it (so requests made in
    the block carry it); a no-op without tracing or a parent."""
    if _provider is None or parent is None:
        yield None
        return
    with _tracer(service).start_as_current_span(
        name, context=_remote(parent), attributes=dict(attributes)
    ) as current:
        yield current


def task_environment(fallback: str | None) -> dict[str, str]:
    """``TRACEPARENT`` (and ``TRACESTATE`` when there is one) for an attempt's process, so
    that its own spans join the task's trace: the current span (the worker's run span)
    as parent, or ``fallback`` (the claim's ``traceparent``) when this process does not
    trace; empty when neither is known."""
    current = trace.get_current_span().get_span_context() if _provider is not None else None
    if current is None or not current.is_valid:
        return {"TRACEPARENT": fallback} if fallback else {}
    env = {"TRACEPARENT": traceparent(current)}
    if current.trace_state:
        env["TRACESTATE"] = current.trace_state.to_header()
    return env


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the current span's ``traceparent``, when tracing."""
    if _provider is not None:
        propagate.inject(headers)
    return headers


def now_ns() -> int:
    return time.time_ns()
