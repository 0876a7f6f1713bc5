"""OpenTelemetry traces, caught by the SDK's in-memory exporter: a task is one trace from
its submission through the claim, the worker agent's run and the report; a workflow run
is one trace whose node releases link to their tasks' traces; a task's own spans, sent by
its process to an OTLP receiver, join its trace under the run span (``TRACEPARENT``)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.common import tracing
from libs.common.client import CoreClient
from libs.common.models import WORKER_LEASE_HEADER, Assignment
from services.worker.agent import Agent
from services.worker.host import Host
from services.worker.settings import WorkerSettings
from tests.fixtures.dag import Runner, Worker, node, start_dag, workflow
from tests.support import Core, shell_spec, spec


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    caught = InMemorySpanExporter()
    assert tracing.setup("test", caught) is not None
    yield caught
    tracing.shutdown()


def finished(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    assert tracing.setup("test") is not None
    tracing.setup("test").force_flush()  # type: ignore[union-attr]
    return list(exporter.get_finished_spans())


def of_task(spans: list[ReadableSpan], task_id: int) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans if (s.attributes or {}).get("cairn.task_id") == task_id}


def run_one(core: Core, body: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], Assignment]:
    """Submit ``body``, claim it as a registered worker and run it with a real agent to
    its report; the task as it ended and its assignment."""
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=body).raise_for_status().json()
        agent_http = core.client("agent", "worker")
        offer = {"hostname": "h", "queues": ["default"], "cpu": 4, "memory_mb": 4096}
        registered = agent_http.post("/v1/workers", json=offer).json()
        worker_id, lease = registered["worker"]["id"], registered["lease"]
        agent_http.headers[WORKER_LEASE_HEADER] = lease
        room = {"cpu": 4, "memory_mb": 4096}
        [raw] = agent_http.post(f"/v1/workers/{worker_id}/claim", json=room).json()["attempts"]
        assignment = Assignment.model_validate(raw)

        async def run_it() -> None:
            # Isolation is not this test's subject (tests/security is).
            settings = WorkerSettings(
                home=tmp_path / "worker", url=core.url, worker_isolation="none"
            )
            host = Host(settings, settings.home / "logs")
            host.start()
            async with CoreClient(core.url, core.tokens["agent"]) as client:
                client.use_lease(lease)
                agent = Agent(settings, client, core.tokens["agent"], host)
                agent.worker_id = worker_id
                try:
                    await agent._attempt(assignment)
                finally:
                    await host.close()

        asyncio.run(run_it())
        ended = alice.get(f"/v1/tasks/{task['id']}").json()
        agent_http.close()
    return ended, assignment


# The agent's log upload passes bytes as data=, which httpx deprecates (not this test's
# subject; in the agent's own process the warning is not an error).
@pytest.mark.filterwarnings("ignore:Use 'content=<...>'")
def test_a_task_is_one_trace_from_submit_through_claim_run_and_report(
    core: Core, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    task, assignment = run_one(core, spec(), tmp_path)
    assert task["state"] == "succeeded"
    spans = of_task(finished(exporter), task["id"])
    submit, claim = spans["cairn.task.submit"], spans["cairn.task.claim"]
    run, report = spans["cairn.attempt.run"], spans["cairn.task.report"]
    expected = tracing.task_context(task["id"], datetime.fromisoformat(task["created_at"]))
    assert submit.context.trace_id == expected.trace_id
    assert submit.context.span_id == expected.span_id and submit.parent is None
    assert {s.context.trace_id for s in spans.values()} == {expected.trace_id}
    assert claim.parent.span_id == submit.context.span_id  # type: ignore[union-attr]
    assert run.parent.span_id == claim.context.span_id  # type: ignore[union-attr]
    assert report.parent.span_id == run.context.span_id  # type: ignore[union-attr]
    assert run.attributes["cairn.outcome"] == report.attributes["cairn.outcome"] == "succeeded"
    assert report.attributes["cairn.state"] == "succeeded"
    assert run.attributes["cairn.attempt_id"] == assignment.attempt_id


class Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: each export request's spans kept as decoded."""

    got: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.server.got.append(request)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


# The task's own program: a span of its work under the context Cairn gave it, exported
# over OTLP/HTTP with the SDK, as an instrumented program would.
TASK_PROGRAM = """
import os
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
carrier = {"traceparent": os.environ["TRACEPARENT"]}
provider.get_tracer("task").start_span("task.work", context=extract(carrier)).end()
provider.shutdown()
"""


@pytest.mark.filterwarnings("ignore:Use 'content=<...>'")
def test_a_tasks_own_spans_join_its_trace_under_the_run_span(
    core: Core, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.got = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    body = shell_spec(
        f'exec {sys.executable} -c "$PROGRAM"',
        env={"PROGRAM": TASK_PROGRAM, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint},
    )
    try:
        task, _ = run_one(core, body, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert task["state"] == "succeeded", task
    [request] = server.got  # type: ignore[attr-defined]
    [work] = [s for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]
    run = of_task(finished(exporter), task["id"])["cairn.attempt.run"]
    expected = tracing.task_context(task["id"], datetime.fromisoformat(task["created_at"]))
    assert work.name == "task.work"
    assert int.from_bytes(work.trace_id, "big") == expected.trace_id
    assert int.from_bytes(work.parent_span_id, "big") == run.context.span_id


def test_a_workflow_run_is_a_trace_whose_releases_link_to_their_tasks(
    core: Core, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    dag = start_dag(core, tmp_path / "dag")
    worker = Worker(core)
    try:
        with dag.client() as http:
            run = Runner(http).run(workflow("pair", [node("a"), node("b", "a")]))
    finally:
        worker.stop()
        dag.stop()
    assert run["state"] == "succeeded"
    spans = finished(exporter)
    [root] = [s for s in spans if s.name == "cairn.dag.run"]
    expected = tracing.run_context(run["id"], datetime.fromisoformat(run["created_at"]))
    assert (root.context.trace_id, root.context.span_id) == (expected.trace_id, expected.span_id)
    releases = {s.attributes["cairn.node"]: s for s in spans if s.name == "cairn.dag.release"}
    assert set(releases) == {"a", "b"}
    for name, release in releases.items():
        assert release.context.trace_id == expected.trace_id
        assert release.parent.span_id == expected.span_id  # type: ignore[union-attr]
        [link] = release.links
        submitted = of_task(spans, release.attributes["cairn.task_id"])["cairn.task.submit"]
        assert link.context.trace_id == submitted.context.trace_id, name
        assert link.context.span_id == submitted.context.span_id


def test_tracing_is_off_without_the_environment_asking(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.setup("core") is None and not tracing.enabled()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.setup("core") is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    provider = tracing.setup("core")
    try:
        assert provider is not None and tracing.enabled()
        assert provider.resource.attributes["service.name"] == "cairn-core"
    finally:
        tracing.shutdown()
    assert not tracing.enabled()
