"""cairn.sdk's client side against a scripted DAG service (httpx.MockTransport): what
apply, start and wait send, and what they make of the answers; ``cairn dag apply``
refusing and printing without sending."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from cairn.cli import app
from cairn.sdk import (
    Artifact,
    Client,
    DefinitionError,
    Node,
    RunFailed,
    Workflow,
    load_file,
    param,
)

SHA = "ab" * 32
ART = Artifact(uri="s3://bin/etl", sha256=SHA)
NOW = "2026-12-05T00:00:00Z"


def run_body(state: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": 9, "owner": "alice", "workflow": "etl", "workflow_version": 3,
        "params": {"day": "d1"}, "state": state, "idempotency_key": "k",
        "created_at": NOW, "started_at": NOW, "finished_at": None, **extra,
    }  # fmt: skip


def node_body(name: str, state: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "state": state, "trigger_rule": "all_success", "depends_on": [],
        "try_number": 1, "task_id": 1, "updated_at": NOW, **extra,
    }  # fmt: skip


class Service:
    """Answers as the DAG service would; keeps every request."""

    def __init__(self, polls: list[dict[str, Any]]) -> None:
        self.sent: list[httpx.Request] = []
        self.polls = polls

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if request.url.path == "/v1/workflows":
            body = json.loads(request.content)
            stored = {
                "id": 1, "owner": "alice", "name": body["name"], "version": 3,
                "definition": body, "created_at": NOW,
            }  # fmt: skip
            return httpx.Response(201, json=stored)
        if request.url.path.endswith("/runs"):
            return httpx.Response(201, json=run_body("queued"))
        return httpx.Response(200, json=self.polls.pop(0))


def etl() -> Workflow:
    with Workflow("etl", params={"day": None}) as wf:
        a = Node("extract", artifact=ART, args=[param("day")], outputs=["rows"])
        a >> Node("load", artifact=ART, args=[a.outputs.rows])
    return wf


def test_apply_sends_the_rendered_definition_and_start_and_wait_follow_the_run() -> None:
    done = run_body(
        "succeeded",
        nodes=[
            node_body("extract", "succeeded", outputs={"rows": 7}),
            node_body("load", "succeeded"),
        ],
    )
    service = Service([run_body("running"), run_body("running"), done])
    client = Client("http://dag.test", "tok", transport=httpx.MockTransport(service))
    wf = etl()
    [applied] = client.apply(wf)
    assert (applied.name, applied.version, applied.created) == ("etl", 3, True)
    assert json.loads(service.sent[0].content) == wf.to_dict()
    assert service.sent[0].headers["Authorization"] == "Bearer tok"
    run = client.start(wf, {"day": "d1"}, idempotency_key="k", timeout_s=60, task_timeout_s=30)
    assert json.loads(service.sent[1].content) == {
        "params": {"day": "d1"},
        "idempotency_key": "k",
        "timeout_s": 60,
        "task_timeout_s": 30,
    }
    assert service.sent[1].url.path == "/v1/workflows/etl/runs"
    result = run.wait(poll_s=0.001)
    assert [r.url.path for r in service.sent[2:]] == ["/v1/runs/9"] * 3
    assert result.succeeded and result.state == "succeeded"
    assert result.states == {"extract": "succeeded", "load": "succeeded"}
    assert result.outputs == {"extract": {"rows": 7}}
    assert result.check() is result


def test_a_failed_run_says_which_nodes_and_a_wait_can_time_out() -> None:
    failed = run_body(
        "failed",
        nodes=[
            node_body("extract", "failed", error="exit 3"),
            node_body("load", "upstream_failed"),
        ],
    )
    service = Service([failed, failed, run_body("running"), run_body("running")])
    client = Client("http://dag.test", "tok", transport=httpx.MockTransport(service))
    result = client.run(9).wait()
    assert result.errors == {"extract": "exit 3"}
    with pytest.raises(RunFailed, match="run 9 failed: extract: failed, load: upstream_failed"):
        result.check()
    with pytest.raises(TimeoutError, match="run 9 is still running after 0 s"):
        client.run(9).wait(timeout_s=0)


def test_nothing_is_sent_when_one_workflow_does_not_render() -> None:
    service = Service([])
    client = Client("http://dag.test", "tok", transport=httpx.MockTransport(service))
    with Workflow("loop") as bad:
        a, b = Node("a", artifact=ART), Node("b", artifact=ART)
        a >> b >> a
    with pytest.raises(DefinitionError, match="cycle: a -> b -> a"):
        client.apply(etl(), bad)
    assert service.sent == []


def test_the_client_works_inside_a_running_event_loop() -> None:
    service = Service([run_body("succeeded")])
    client = Client("http://dag.test", "tok", transport=httpx.MockTransport(service))

    async def notebook() -> str:
        return str(client.run(9).last.state)

    assert asyncio.run(notebook()) == "succeeded"


def test_the_client_finds_the_service_as_the_cli_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAIRN_DAG_URL", "http://dag.example:8402")
    monkeypatch.setenv("CAIRN_TOKEN", "from-env")
    monkeypatch.setenv("CAIRN_CONFIG", "/nonexistent/config.toml")
    client = Client()
    assert client.dag_url == "http://dag.example:8402"
    assert client._token == "from-env"


PIPELINE = """
from cairn.sdk import Artifact, Node, Workflow
from helpers import ART

for table in ("sales", "stock"):
    with Workflow(f"load-{table}"):
        Node("extract", artifact=ART, args=[table]) >> Node("load", artifact=ART)

if __name__ == "__main__":
    raise SystemExit("not when applied")
"""


def test_load_finds_every_workflow_a_file_makes(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text(
        f"from cairn.sdk import Artifact\nART = Artifact(uri='s3://bin/etl', sha256='{SHA}')\n"
    )
    (tmp_path / "pipeline.py").write_text(PIPELINE)
    found = load_file(tmp_path / "pipeline.py")
    assert [w.name for w in found] == ["load-sales", "load-stock"]
    assert found[1].to_dict()["nodes"][1]["depends_on"] == ["extract"]
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(DefinitionError, match="makes no Workflow"):
        load_file(tmp_path / "empty.py")


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CliRunner:
    # Nothing listens here: a command that sent anything would fail to connect.
    monkeypatch.setenv("CAIRN_DAG_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CAIRN_TOKEN", "tok")
    monkeypatch.setenv("CAIRN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CAIRN_CONFIG", raising=False)
    return CliRunner()


def test_cairn_dag_apply_dry_run_prints_the_definitions(cli: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text(
        f"from cairn.sdk import Artifact\nART = Artifact(uri='s3://bin/etl', sha256='{SHA}')\n"
    )
    (tmp_path / "pipeline.py").write_text(PIPELINE)
    done = cli.invoke(app, ["dag", "apply", str(tmp_path / "pipeline.py"), "--dry-run"])
    assert done.exit_code == 0, done.output
    printed = json.loads(done.output)
    assert [d["name"] for d in printed] == ["load-sales", "load-stock"]
    assert printed[0]["nodes"][0]["task"]["args"] == ["sales"]


def test_cairn_dag_apply_refuses_a_cycle_naming_it_and_sends_nothing(
    cli: CliRunner, tmp_path: Path
) -> None:
    (tmp_path / "loop.py").write_text(
        f"from cairn.sdk import Artifact, Node, Workflow\n"
        f"ART = Artifact(uri='s3://bin/etl', sha256='{SHA}')\n"
        "with Workflow('loop'):\n"
        "    a, b = Node('a', artifact=ART), Node('b', artifact=ART)\n"
        "    a >> b >> a\n"
    )
    done = cli.invoke(app, ["dag", "apply", str(tmp_path / "loop.py")])
    assert done.exit_code == 2
    assert "the nodes form a cycle: a -> b -> a" in done.output
    assert "cannot reach" not in done.output
