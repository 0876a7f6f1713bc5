"""The typed HTTP client of the DAG service, for cron, the CLI and scripts.

Errors are raised as in ``libs.common.client``: the matching ``CairnError`` rebuilt from
the problem+json answer, or httpx's ``TransportError``.
"""

from __future__ import annotations

from typing import Any, Literal

from libs.common.client import ApiClient, _owner, read_answer
from libs.common.dag_models import (
    ApprovalDecision,
    EventDelivery,
    Graph,
    Run,
    RunClear,
    RunCreate,
    RunEvent,
    RunFire,
    RunList,
    RunRetry,
    RunState,
    TriggerCreate,
    TriggerCreated,
    TriggerList,
    Workflow,
    WorkflowCreate,
    WorkflowHistory,
    WorkflowList,
)


class DagClient(ApiClient):
    """An async client of the DAG service's API. Pass ``transport`` to test without a
    server."""

    async def put_workflow(
        self, definition: WorkflowCreate, *, on_behalf_of: str | None = None
    ) -> tuple[Workflow, bool]:
        """Store a definition; return its version and whether this call made it (False:
        it is the same as the newest version)."""
        response = await self._call(
            "POST",
            "/v1/workflows",
            content=definition.model_dump_json(exclude_unset=True),
            headers=_owner(on_behalf_of),
        )
        return read_answer(Workflow, response), response.status_code == 201

    async def get_workflow(self, name: str, version: int | None = None) -> Workflow:
        params = {"version": version} if version else {}
        response = await self._call("GET", f"/v1/workflows/{name}", params=params)
        return read_answer(Workflow, response)

    async def list_workflows(self) -> WorkflowList:
        response = await self._call("GET", "/v1/workflows")
        return read_answer(WorkflowList, response)

    async def start_run(
        self,
        workflow: str,
        params: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        on_behalf_of: str | None = None,
        *,
        version: int | None = None,
        fire: RunFire | None = None,
        timeout_s: int | None = None,
        task_timeout_s: int | None = None,
    ) -> tuple[Run, bool]:
        """Start a run; return it and whether this call created it (False: the owner used
        ``idempotency_key`` before, and that run is returned). A service token may start
        it ``on_behalf_of`` another owner, who then owns the run and its tasks."""
        body = RunCreate(
            params=params or {},
            idempotency_key=idempotency_key,
            version=version,
            fire=fire,
            timeout_s=timeout_s,
            task_timeout_s=task_timeout_s,
        )
        response = await self._call(
            "POST",
            f"/v1/workflows/{workflow}/runs",
            content=body.model_dump_json(exclude_none=True),
            headers=_owner(on_behalf_of),
        )
        return read_answer(Run, response), response.status_code == 201

    async def get_run(self, run_id: int) -> Run:
        """The run with its nodes' states."""
        response = await self._call("GET", f"/v1/runs/{run_id}")
        return read_answer(Run, response)

    async def list_runs(
        self,
        *,
        workflow: str | None = None,
        state: RunState | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> RunList:
        params: dict[str, Any] = {"limit": limit}
        for key, value in (("workflow", workflow), ("state", state), ("cursor", cursor)):
            if value is not None:
                params[key] = str(value)
        response = await self._call("GET", "/v1/runs", params=params)
        return read_answer(RunList, response)

    async def cancel_run(self, run_id: int) -> Run:
        """Cancel the run; its live node tasks are cancelled in core."""
        response = await self._call("POST", f"/v1/runs/{run_id}/cancel")
        return read_answer(Run, response)

    async def retry_run(self, run_id: int, *, failed_instances: bool = False) -> Run:
        """Run a failed or cancelled run again from the nodes that did not succeed; with
        ``failed_instances``, a failed mapped node runs only its failed instances again."""
        body = RunRetry(instances="failed" if failed_instances else "all")
        response = await self._call(
            "POST", f"/v1/runs/{run_id}/retry", content=body.model_dump_json()
        )
        return read_answer(Run, response)

    async def clear_run(self, run_id: int, node: str, *, downstream: bool = True) -> Run:
        """Run a finished run again from ``node`` (and, unless ``downstream`` is false,
        every node below it)."""
        body = RunClear(node=node, downstream=downstream)
        response = await self._call(
            "POST", f"/v1/runs/{run_id}/clear", content=body.model_dump_json()
        )
        return read_answer(Run, response)

    async def decide(
        self, run_id: int, node: str, decision: Literal["approve", "reject"], comment: str = ""
    ) -> Run:
        """Approve or reject the run's waiting approval gate ``node``."""
        body = ApprovalDecision(comment=comment)
        response = await self._call(
            "POST", f"/v1/runs/{run_id}/nodes/{node}/{decision}", content=body.model_dump_json()
        )
        return read_answer(Run, response)

    async def graph(self, run_id: int) -> Graph:
        response = await self._call("GET", f"/v1/runs/{run_id}/graph")
        return read_answer(Graph, response)

    async def mermaid(self, run_id: int) -> str:
        response = await self._call("GET", f"/v1/runs/{run_id}/graph", params={"format": "mermaid"})
        return response.text

    async def send_event(
        self, run_id: int, name: str, data: dict[str, Any] | None = None
    ) -> RunEvent:
        """Deliver event ``name`` to the run (kept once; the node waiting for it
        succeeds with ``data`` as its outputs)."""
        body = EventDelivery(data=data or {})
        response = await self._call(
            "POST", f"/v1/runs/{run_id}/events/{name}", content=body.model_dump_json()
        )
        return read_answer(RunEvent, response)

    async def create_trigger(self, workflow: str, body: TriggerCreate) -> TriggerCreated:
        """A new signed trigger of ``workflow``, with its secret (shown this once)."""
        response = await self._call(
            "POST", f"/v1/workflows/{workflow}/triggers", content=body.model_dump_json()
        )
        return read_answer(TriggerCreated, response)

    async def list_triggers(self, workflow: str) -> TriggerList:
        response = await self._call("GET", f"/v1/workflows/{workflow}/triggers")
        return read_answer(TriggerList, response)

    async def delete_trigger(self, workflow: str, trigger_id: int) -> None:
        await self._call("DELETE", f"/v1/workflows/{workflow}/triggers/{trigger_id}")

    async def history(self, workflow: str, limit: int = 25) -> WorkflowHistory:
        """The workflow's newest ``limit`` runs (at most 100) by node."""
        response = await self._call(
            "GET", f"/v1/workflows/{workflow}/history", params={"limit": limit}
        )
        return read_answer(WorkflowHistory, response)
