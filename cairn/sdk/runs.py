"""Submitting workflows and following their runs, through the CLI's own client of the DAG
service (``libs.common.dag_client.DagClient``) and the CLI's settings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from cairn import config
from cairn.sdk.definition import Workflow, render_all
from libs.common.client import DEFAULT_TIMEOUT
from libs.common.dag_client import DagClient
from libs.common.dag_models import RUN_FINAL, NodeState, Run, RunState
from libs.common.dag_models import Node as NodeStatus
from libs.common.dag_models import Workflow as StoredWorkflow

T = TypeVar("T")


@dataclass(frozen=True)
class Applied:
    """A workflow stored: its version, and whether this call made it (False: the
    definition is the same as the newest version's)."""

    name: str
    version: int
    created: bool
    stored: StoredWorkflow


async def apply(dag: DagClient, workflows: Sequence[Workflow]) -> list[Applied]:
    """Store each workflow's definition as its next version; every one is rendered and
    checked before the first is sent."""
    definitions = render_all(workflows)
    applied = []
    for definition in definitions:
        stored, created = await dag.put_workflow(definition)
        applied.append(Applied(stored.name, stored.version, created, stored))
    return applied


async def wait_for_run(
    dag: DagClient, run_id: int, *, timeout_s: float | None = None, poll_s: float = 1.0
) -> Run:
    """The run once it has ended (succeeded, failed or cancelled); ``TimeoutError`` if it
    has not within ``timeout_s`` (the run goes on)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        run = await dag.get_run(run_id)
        if run.state in RUN_FINAL:
            return run
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"run {run_id} is still {run.state} after {timeout_s} s")
        await asyncio.sleep(poll_s)


class RunFailed(Exception):
    """The run ended but did not succeed."""

    def __init__(self, result: RunResult) -> None:
        self.result = result
        failed = ", ".join(f"{n}: {s}" for n, s in result.states.items() if s != "succeeded")
        reason = f" ({result.run.reason})" if result.run.reason else ""
        super().__init__(f"run {result.id} {result.state}{reason}: {failed or '-'}")


@dataclass(frozen=True)
class RunResult:
    """A run as it ended: its state, each node's state, error and outputs."""

    run: Run

    @property
    def id(self) -> int:
        return self.run.id

    @property
    def state(self) -> RunState:
        return self.run.state

    @property
    def succeeded(self) -> bool:
        return self.run.state == RunState.SUCCEEDED

    @property
    def nodes(self) -> dict[str, NodeStatus]:
        """Every node by name, mapped instances as ``NODE[I]``."""
        return {node.name: node for node in self.run.nodes}

    @property
    def states(self) -> dict[str, NodeState]:
        return {node.name: node.state for node in self.run.nodes}

    @property
    def outputs(self) -> dict[str, dict[str, Any]]:
        """What each node handed on (a mapped node: each output as the list of its
        instances' values); nodes that kept none are left out."""
        return {n.name: n.outputs for n in self.run.nodes if n.outputs is not None}

    @property
    def errors(self) -> dict[str, str]:
        return {n.name: n.error for n in self.run.nodes if n.error}

    def check(self) -> RunResult:
        """This result, or ``RunFailed`` if the run did not succeed."""
        if not self.succeeded:
            raise RunFailed(self)
        return self


class Client:
    """The DAG service, found as the CLI finds it: ``dag_url`` and ``token`` when given,
    else ``CAIRN_DAG_URL`` / ``CAIRN_TOKEN``, the config file, and the local admin token
    of ``cairn up`` (``cairn/config.py``). Calls block; inside a running event loop (a
    notebook) they run on a thread of their own."""

    def __init__(
        self,
        dag_url: str | None = None,
        token: str | None = None,
        *,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if dag_url is None or token is None:
            settings = config.load(dag_url=dag_url, token=token)
            dag_url, token = settings.dag_url, settings.bearer()
        self.dag_url: str = dag_url
        self._token = token
        self._timeout = timeout
        self._transport = transport

    def __repr__(self) -> str:
        return f"Client({self.dag_url!r})"

    def call(self, work: Callable[[DagClient], Awaitable[T]]) -> T:
        """Run ``work`` with a ``DagClient`` of this service, and return what it returns."""

        async def go() -> T:
            async with DagClient(
                self.dag_url, self._token, timeout=self._timeout, transport=self._transport
            ) as dag:
                return await work(dag)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(go())
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, go()).result()

    def apply(self, *workflows: Workflow) -> list[Applied]:
        """Store the workflows (each a new version when its definition changed); nothing
        is sent unless every one renders."""
        return self.call(lambda dag: apply(dag, workflows))

    def start(
        self,
        workflow: Workflow | str,
        params: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        version: int | None = None,
        timeout_s: int | None = None,
        task_timeout_s: int | None = None,
    ) -> RunHandle:
        """Start a run of the workflow's newest version (or ``version``) with ``params``
        over its defaults. With a key used before, the run it started is returned.
        ``task_timeout_s`` fills the ``timeout_s`` of its node tasks that set none (over
        the workflow's ``task_timeout_s``)."""
        name = workflow if isinstance(workflow, str) else workflow.name

        async def go(dag: DagClient) -> Run:
            run, _ = await dag.start_run(
                name,
                dict(params or {}),
                idempotency_key=idempotency_key,
                version=version,
                timeout_s=timeout_s,
                task_timeout_s=task_timeout_s,
            )
            return run

        return RunHandle(self, self.call(go))

    def run(self, run_id: int) -> RunHandle:
        """A handle on a run that exists."""
        return RunHandle(self, self.call(lambda dag: dag.get_run(run_id)))


class RunHandle:
    """A run started (or found): ``wait()`` follows it to its end."""

    def __init__(self, client: Client, run: Run) -> None:
        self.client = client
        self.id: int = run.id
        self.workflow: str = run.workflow
        self.version: int = run.workflow_version
        self.last: Run = run

    def __repr__(self) -> str:
        return f"RunHandle({self.id}, {self.workflow!r} v{self.version}, {self.last.state})"

    def refresh(self) -> Run:
        """The run now, with its nodes."""
        self.last = self.client.call(lambda dag: dag.get_run(self.id))
        return self.last

    def wait(self, timeout_s: float | None = None, *, poll_s: float = 1.0) -> RunResult:
        """Block until the run has ended; return its final state and nodes.
        ``TimeoutError`` after ``timeout_s`` (the run goes on)."""
        self.last = self.client.call(
            lambda dag: wait_for_run(dag, self.id, timeout_s=timeout_s, poll_s=poll_s)
        )
        return RunResult(self.last)

    def cancel(self) -> Run:
        """Cancel the run; its live node tasks are cancelled in core."""
        self.last = self.client.call(lambda dag: dag.cancel_run(self.id))
        return self.last
