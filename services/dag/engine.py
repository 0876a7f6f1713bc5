"""The DAG service's one loop: admit queued runs, release ready nodes to core, ask core to
cancel the tasks of cancelled runs, then read core's event feed after the stored cursor
and apply what it says to node states, storing the new cursor in the same transaction.

Why a release happens exactly once: a node becomes ``ready`` in a committed transaction;
its task is submitted with the idempotency key ``dag:RUN:NODE:TRY``, so submitting again
after a crash, a timeout or a 5xx returns the same task; the task's id is then recorded.
Releases happen before the feed is read in each turn, so every event of a task is read
after its id is known (the feed never hands out an event older than a cursor given out
before the task existed). Only one process runs the loop (a PostgreSQL advisory lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.client import CoreClient
from libs.common.dag_models import (
    NODE_FINAL,
    NodeState,
    RunState,
    WorkflowCreate,
)
from libs.common.errors import CairnError, Conflict, InvalidInput, NotFound
from libs.common.models import MAX_BATCH, Event, EventPage, TaskCreate
from libs.common.notify_models import NotificationEvent
from libs.common.states import TaskState
from services.dag import store
from services.dag.domain import graph, rules
from services.dag.domain.templates import Renderer, RunContext
from services.dag.metrics import DagMetrics
from services.dag.settings import DagSettings

log = logging.getLogger("cairn.dag.engine")

N = NodeState
_LEADER_KEY = 0x0CA1_0DA6
# What a task's event does to its node: the states it may move from, and the new one.
_LIVE = frozenset({N.RELEASED, N.RUNNING, N.CANCELLING})


def _after_event(node: store.NodeRow, state: NodeState, event: Event) -> NodeState | None:
    """The node's next state after one event of its task, or None if it stays."""
    if state not in _LIVE:
        return None
    to = event.to_state
    if to is TaskState.RUNNING:
        return N.RUNNING if state is N.RELEASED else None
    if to is TaskState.SUCCEEDED:
        return N.SUCCEEDED
    if to is TaskState.CANCELLED and state is N.CANCELLING:
        return N.CANCELLED
    if to in (TaskState.DEAD, TaskState.CANCELLED):
        return N.FAILED
    return None


class Graphs:
    """Parsed, ordered definitions by workflow version id; versions never change."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._dags: OrderedDict[int, graph.Dag] = OrderedDict()

    async def get(self, conn: AsyncConnection, workflow_id: int) -> graph.Dag:
        dag = self._dags.get(workflow_id)
        if dag is None:
            row = await store.workflow_by_id(conn, workflow_id)
            dag = graph.build(WorkflowCreate.model_validate(row.definition))
            self.put(workflow_id, dag)
        self._dags.move_to_end(workflow_id)
        return dag

    def put(self, workflow_id: int, dag: graph.Dag) -> None:
        self._dags[workflow_id] = dag
        while len(self._dags) > self.size:
            self._dags.popitem(last=False)


class Engine:
    """Runs the loop; ``wake()`` makes it look for new work at once."""

    def __init__(self, engine: AsyncEngine, settings: DagSettings, graphs: Graphs) -> None:
        self.db = engine
        self.settings = settings
        self.graphs = graphs
        self.core = CoreClient(settings.url, settings.token)
        self._wake = asyncio.Event()
        self._cursor: str | None = None
        self._full_page = False
        self.leading = False
        self.metrics = DagMetrics(lambda: self.leading)
        self._ended: list[RunState] = []
        self._failed: list[tuple[Any, int]] = []  # (run, its newest node try) to notify

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        await self.core.aclose()

    # --- the loop --------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Lead (or wait to), then turn until cancelled. A failed turn is retried with
        backoff; leadership is given up only when its connection is lost."""
        pause = self.settings.retry_base_s
        while True:
            try:
                async with self.db.connect() as leader:
                    await self._lead(leader)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("lost the DAG loop's database session: %r", exc)
                self._cursor = None
                await self._sleep(pause)
                pause = min(pause * 2, self.settings.retry_cap_s)

    async def _lead(self, leader: AsyncConnection) -> None:
        while not await leader.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": _LEADER_KEY}):
            await leader.commit()
            await self._sleep(1.0)
        await leader.commit()
        log.info("leading the DAG loop")
        self.leading = True
        try:
            await self._turn_forever(leader)
        finally:
            self.leading = False
            with contextlib.suppress(Exception):
                await leader.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LEADER_KEY})
                await leader.commit()

    async def _turn_forever(self, leader: AsyncConnection) -> None:
        pause = self.settings.retry_base_s
        while True:
            try:
                await self.step()
            except Exception as exc:
                log.warning("a turn of the DAG loop failed, again in %.2f s: %r", pause, exc)
                self._cursor = None
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.settings.retry_cap_s)
                # Still the leader? A lost session raises out and leads again.
                await leader.scalar(text("SELECT 1"))
                await leader.commit()
            else:
                pause = self.settings.retry_base_s

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def step(self) -> None:
        """One turn: admit, release, cancel, then read and apply one page of the feed."""
        self._wake.clear()
        await self.admit()
        await self.release()
        await self.cancel_live()
        page = await self._read()
        if page is not None:
            await self.apply(page)

    async def _read(self) -> EventPage | None:
        if self._cursor is None:
            async with self.db.connect() as conn:
                self._cursor = await store.read_cursor(conn)
        wait = 0 if self._full_page else self.settings.feed_wait_s
        poll = asyncio.create_task(self.core.events(self._cursor, self.settings.feed_page, wait))
        # Whatever happens to this turn, the poll's outcome is collected.
        poll.add_done_callback(lambda t: t.cancelled() or t.exception())
        woken = asyncio.create_task(self._wake.wait())
        try:
            done, _ = await asyncio.wait({poll, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not poll.done():
                poll.cancel()
        if poll not in done:
            return None
        page = poll.result()
        self._full_page = len(page.items) >= self.settings.feed_page
        return page

    # --- admitting runs --------------------------------------------------------------------

    async def admit(self) -> None:
        async with self.db.connect() as conn:
            queued = await store.queued_runs(conn)
        groups = {(r.owner, r.workflow) for r in queued}
        for owner, workflow in sorted(groups):
            async with self.db.begin() as conn:
                most = await store.newest_max_active(conn, owner, workflow)
                for run in await store.admit(conn, owner, workflow, most):
                    await self._settle(conn, run, await store.nodes_of(conn, [run.id]))

    # --- applying the feed -----------------------------------------------------------------

    async def apply(self, page: EventPage) -> None:
        """Apply one page to the nodes whose tasks it names, and store its cursor, in one
        transaction."""
        by_task: dict[int, list[Event]] = defaultdict(list)
        for event in page.items:
            by_task[event.task_id].append(event)
        self._ended.clear()
        self._failed.clear()
        async with self.db.begin() as conn:
            run_ids = await store.runs_of_tasks(conn, by_task) if by_task else []
            if run_ids:
                runs = await store.lock_runs(conn, run_ids)
                nodes = await store.nodes_of(conn, run_ids, lock=True)
                per_run: dict[int, list[store.NodeRow]] = defaultdict(list)
                for node in nodes:
                    per_run[node.run_id].append(node)
                for run in runs:
                    await self._apply_run(conn, run, per_run[run.id], by_task)
            await store.store_cursor(conn, page.next_cursor)
        self._cursor = page.next_cursor
        for state in self._ended:
            self.metrics.finished.labels(state.value).inc()
        await self._tell_failed()

    async def _apply_run(
        self,
        conn: AsyncConnection,
        run: Any,
        nodes: list[store.NodeRow],
        by_task: dict[int, list[Event]],
    ) -> None:
        changes: dict[str, tuple[NodeState, str | None]] = {}
        for node in nodes:
            if node.task_id is None or node.task_id not in by_task:
                continue
            state = node.state
            for event in by_task[node.task_id]:
                state = _after_event(node, state, event) or state
            if state is not node.state:
                error = (
                    f"task {node.task_id} ended {by_task[node.task_id][-1].to_state}"
                    if state is N.FAILED
                    else None
                )
                changes[node.name] = (state, error)
        await store.set_nodes(conn, run.id, changes)
        if run.state == RunState.RUNNING and changes:
            current = [
                store.NodeRow(
                    n.run_id,
                    n.name,
                    changes.get(n.name, (n.state,))[0],
                    n.try_number,
                    n.task_id,
                    n.error,
                )
                for n in nodes
            ]
            await self._settle(conn, run, current)

    async def _settle(self, conn: AsyncConnection, run: Any, nodes: list[store.NodeRow]) -> None:
        """Apply the trigger rules to a running run's pending nodes; end it if all ended."""
        dag = await self.graphs.get(conn, run.workflow_id)
        states = {n.name: n.state for n in nodes}
        changed = rules.settle(dag.order, dag.upstream, {n: dag.rule(n) for n in dag.order}, states)
        await store.set_nodes(
            conn, run.id, {name: (state, None) for name, state in changed.items()}
        )
        outcome = rules.run_outcome(dag.leaves, states)
        if outcome is not None:
            await store.finish_run(conn, run.id, outcome)
            self._ended.append(outcome)
            if outcome is RunState.FAILED:
                self._failed.append((run, max((n.try_number for n in nodes), default=0)))
        if any(state is N.READY for state in changed.values()) or outcome is not None:
            # New work for the releaser, or room for a queued run of this workflow.
            self._wake.set()

    # --- releasing ready nodes -------------------------------------------------------------

    async def release(self) -> None:
        """Submit every ready node's task and record its id."""
        while True:
            async with self.db.connect() as conn:
                read_at = time.monotonic()
                ready = await store.ready_nodes(conn, MAX_BATCH)
                specs = await self._render(conn, ready)
            if not ready:
                return
            by_owner: dict[str, list[tuple[Any, TaskCreate]]] = defaultdict(list)
            for row in ready:
                spec = specs.get((row.run_id, row.name))
                if spec is not None:
                    by_owner[row.owner].append((row, spec))
            for owner, items in by_owner.items():
                await self._submit(owner, items, read_at)
            if len(ready) < MAX_BATCH:
                return

    async def _render(
        self, conn: AsyncConnection, ready: list[Any]
    ) -> dict[tuple[int, str], TaskCreate]:
        specs: dict[tuple[int, str], TaskCreate] = {}
        for row in ready:
            dag = await self.graphs.get(conn, row.workflow_id)
            context = RunContext(row.run_id, row.workflow, row.owner, row.params)
            try:
                specs[(row.run_id, row.name)] = Renderer(dag, context).task(
                    row.name, row.try_number
                )
            except InvalidInput as exc:
                await self._refused(row, exc)
        return specs

    async def _submit(
        self, owner: str, items: list[tuple[Any, TaskCreate]], read_at: float
    ) -> None:
        try:
            answers = await self.core.submit_batch([spec for _, spec in items], on_behalf_of=owner)
            task_ids = [answer.id for answer in answers]
        except (InvalidInput, Conflict):
            # One of them is refused: find which, one by one (the keys keep it safe).
            task_ids = []
            for row, spec in items:
                try:
                    task, _ = await self.core.submit(spec, on_behalf_of=owner)
                except (InvalidInput, Conflict) as exc:
                    await self._refused(row, exc)
                    task_ids.append(0)
                else:
                    task_ids.append(task.id)
        released = [
            (row.run_id, row.name, row.try_number, task_id)
            for (row, _), task_id in zip(items, task_ids, strict=True)
            if task_id
        ]
        async with self.db.begin() as conn:
            recorded = await store.record_released(conn, released)
        waited = time.monotonic() - read_at
        accepted = {(run_id, name) for run_id, name, _, task_id in released if task_id in recorded}
        for row, _ in items:
            if (row.run_id, row.name) in accepted:
                self.metrics.release_latency.observe(float(row.ready_s) + waited)
        self.metrics.released.inc(len(accepted))
        for _, _, _, task_id in released:
            if task_id not in recorded:
                # The run was cancelled while its task was being submitted.
                await self._cancel_task(task_id)

    async def _refused(self, row: Any, exc: CairnError) -> None:
        log.info(
            "run %s node %s refused: %s",
            row.run_id,
            row.name,
            exc.detail,
            extra={"run_id": row.run_id},
        )
        self._failed.clear()
        async with self.db.begin() as conn:
            await store.fail_ready(
                conn, row.run_id, row.name, f"core refused the task: {exc.detail}"
            )
            run = (await store.lock_runs(conn, [row.run_id]))[0]
            if run.state == RunState.RUNNING:
                await self._settle(conn, run, await store.nodes_of(conn, [row.run_id], lock=True))
        await self._tell_failed()

    async def _tell_failed(self) -> None:
        """Post the runs that just failed (committed) to core for their owners'
        notifications (docs/notifications.md). Best effort: a lost post is logged."""
        failed, self._failed = self._failed, []
        for run, try_number in failed:
            event = NotificationEvent(
                event="run.failed",
                owner=run.owner,
                key=f"run {run.id} try {try_number}",
                summary=f"workflow {run.workflow} run {run.id} failed",
                subject={"run_id": str(run.id), "workflow": run.workflow},
            )
            try:
                await self.core.notify(event)
            except Exception as exc:  # whatever it is, the run's state is stored
                log.warning("run %s: notification not posted: %s", run.id, exc)

    # --- cancelling ------------------------------------------------------------------------

    async def cancel_live(self) -> None:
        async with self.db.connect() as conn:
            live = await store.cancelling_nodes(conn, MAX_BATCH)
        for row in live:
            if await self._cancel_task(row.task_id):
                async with self.db.begin() as conn:
                    await store.cancelled(conn, row.task_id)

    async def _cancel_task(self, task_id: int) -> bool:
        """Ask core to cancel; False when the task had already ended (its event will say
        how)."""
        try:
            await self.core.cancel(task_id)
        except (Conflict, NotFound):
            return False
        return True


def reset_for_retry(dag: graph.Dag, states: dict[str, NodeState]) -> list[str]:
    """The nodes a retry runs again: those that failed, could not run or were cancelled,
    and every skipped node below them (its rule may be met this time)."""
    again = {n for n, s in states.items() if s in (N.FAILED, N.UPSTREAM_FAILED, N.CANCELLED)}
    for name in dag.order:
        if states[name] is N.SKIPPED and any(up in again for up in dag.upstream[name]):
            again.add(name)
    return sorted(again)


def open_nodes(states: Iterable[NodeState]) -> int:
    return sum(1 for s in states if s not in NODE_FINAL)
