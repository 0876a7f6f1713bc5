"""The DAG service's one loop: admit queued runs, release ready nodes to core, ask core to
cancel the tasks of cancelled runs, then read core's event feed after the stored cursor
and apply what it says to node states, storing the new cursor in the same transaction.

Why a release happens exactly once: a node becomes ``ready`` in a committed transaction;
its task is submitted with the idempotency key ``dag:RUN:NODE:TRY``, so submitting again
after a crash, a timeout or a 5xx returns the same task; the task's id is then recorded.
Releases happen before the feed is read in each turn, so every event of a task is read
after its id is known (the feed never hands out an event older than a cursor given out
before the task existed). What the feed never delivers (core's retention purged a task,
or its events, before the loop read them) the resync finds: every ``CAIRN_DAG_RESYNC_S``
it reads from core the tasks of nodes unchanged that long and applies what they say as
the feed would. Only one process runs the loop (``libs/common/leader.py``: an advisory lock and an
epoch that fences every write of the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

import httpx
import orjson
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common import locks, tracing
from libs.common.client import CoreClient
from libs.common.dag_models import (
    MAX_SUBFLOW_DEPTH,
    NODE_FINAL,
    RUN_FINAL,
    NodeSpec,
    NodeState,
    RunState,
    WorkflowCreate,
)
from libs.common.errors import CairnError, Conflict, InvalidInput, NotFound, is_refusal
from libs.common.leader import Elector, LeadershipLost, Lease
from libs.common.models import (
    MAX_BATCH,
    AuditReport,
    Event,
    EventPage,
    NotificationEvent,
    Task,
    TaskCreate,
    first_error,
)
from libs.common.states import FINAL, TaskState
from services.dag import store, traces
from services.dag.domain import conditions, data, graph, rules
from services.dag.domain.templates import (
    Renderer,
    RunContext,
    decision_key,
    merged_params,
    release_key,
)
from services.dag.metrics import DagMetrics
from services.dag.settings import DagSettings

log = logging.getLogger("cairn.dag.engine")

N = NodeState
_LEADER_KEY = locks.DAG_LEADER
_KEYS_PER_LOOKUP = 100  # core's bound on idempotency_key values in one listing
_OUTPUT_FETCHES = 16  # attempts read from core at once for their outputs
# What a task's event does to its node: the states it may move from, and the new one.
_LIVE = frozenset({N.RELEASED, N.RUNNING, N.CANCELLING})
#: the task states whose events may move a node (``_after_event``)
_MOVES = frozenset({TaskState.RUNNING, *FINAL})
#: a feed page that moves no node stores its cursor at most this often
_CURSOR_EVERY_S = 1.0
#: how long the starts of tasks (``released -> running``, which no rule reads) may wait
#: to be written with the next page's events (a short task's end, mostly), counted from
#: when the read that brought them was sent: core holds such a page for that long itself
#: (``hold``), and the loop holds it only for what core's answer left of it
_STARTS_HOLD_S = 0.25
#: tasks whose node the loop keeps in memory once it released them (about 200 bytes each)
_RELEASED_KEPT = 100_000
#: a turn nobody woke checks the lease and asks which chores have work at most this often;
#: a turn that skips them waits on the feed no longer than this
_CHORES_EVERY_S = 0.05
#: the most workflow versions set aside kept in memory (``Engine.set_aside``)
_UNREADABLE_KEPT = 1000
#: Whether the feed's writes (node moves, the runs' ends, the cursor) and the releases'
#: records wait for their WAL's flush at commit. They do not (``Lease.fencing``): on the
#: hop's path that was one disk flush of the two between a task's end and the next
#: node's submission. What a server crash may lose of them is the last fraction of a
#: second of derived state, made again as it was made: the cursor goes back with the
#: nodes it moved (one transaction), so the feed's events are read and applied again; a
#: node whose release record was lost is ``ready`` again and its submission, under the
#: same idempotency key (``dag:RUN:NODE:TRY``), answers the task already made. And any
#: durable commit after them in the same cluster flushes them too (the WAL is one
#: sequence): core's commit of the next node's task does, before it answers.
_FEED_DURABLE = False


class _Released(NamedTuple):
    """A released node as ``store.nodes_of_tasks`` reads it."""

    run_id: int
    name: str
    map_of: str | None
    task_id: int
    workflow_id: int


_ROLES = frozenset({"user", "admin", "service"})  # the roles an audit report names


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


# What a parsed definition holds in memory, measured with tracemalloc: about 3.7 KB per
# node of a small node, plus its strings (about twice the definition's JSON).
_BYTES_PER_NODE = 3072
_BYTES_PER_JSON_BYTE = 2
_NODES = TypeAdapter(list[NodeSpec])
_SLICE = 50


_gc_lock = threading.Lock()
_gc_pauses = 0


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a definition is parsed: the hundreds of
    thousands of objects it makes trigger full collections that hold the GIL, and so the
    event loop, for most of a second (measured: 0.95 s of 1.56 s for 5,000 nodes; 0.05 s
    of 0.43 s without). Counted, so parses in parallel threads nest."""
    global _gc_pauses
    with _gc_lock:
        _gc_pauses += 1
        gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0:
                gc.enable()


def parse(definition: Any) -> tuple[graph.Dag, int]:
    """A stored definition validated and ordered, and its estimated size in bytes (run in
    a thread: a large definition takes seconds)."""
    with _gc_paused():
        return _parse(definition)


def _parse(definition: Any) -> tuple[graph.Dag, int]:
    # Node by slice: one validation call of a whole large definition holds the GIL (and
    # so the event loop) for seconds; the slices leave it room between them.
    raw = definition.get("nodes") or []
    nodes = [
        node
        for at in range(0, len(raw), _SLICE)
        for node in _NODES.validate_python(raw[at : at + _SLICE])
    ]
    body = WorkflowCreate.model_validate({**definition, "nodes": nodes})
    dag = graph.build(body)
    return dag, _estimate(dag, len(orjson.dumps(definition)))


def build_sized(body: WorkflowCreate) -> tuple[graph.Dag, int]:
    """``parse`` for a definition already validated (a submission)."""
    with _gc_paused():
        dag = graph.build(body)
        return dag, _estimate(dag, len(body.model_dump_json()))


def _estimate(dag: graph.Dag, json_bytes: int) -> int:
    return _BYTES_PER_NODE * len(dag.order) + _BYTES_PER_JSON_BYTE * json_bytes


class Unreadable(Exception):
    """A workflow version whose stored definition cannot be parsed any more (stored under
    older bounds, or changed by hand): ``Engine.set_aside`` fails its runs."""

    def __init__(self, workflow_id: int, cause: Exception) -> None:
        if isinstance(cause, ValidationError):
            said = first_error(cause)
        else:
            said = f"{type(cause).__name__}: {cause}"
        self.workflow_id = workflow_id
        self.why = f"its workflow's stored definition can no longer be read ({said})"[:500]
        super().__init__(f"workflow version {workflow_id}: {self.why}")


class Graphs:
    """Parsed, ordered definitions by workflow version id (versions never change), least
    recently used first out, within ``size`` entries and ``max_bytes`` of memory. Parsing
    happens off the event loop."""

    def __init__(self, size: int, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._dags: OrderedDict[int, tuple[graph.Dag, int]] = OrderedDict()

    async def get(self, conn: AsyncConnection, workflow_id: int) -> graph.Dag:
        entry = self._dags.get(workflow_id)
        if entry is None:
            row = await store.workflow_by_id(conn, workflow_id)
            try:
                dag, weight = await asyncio.to_thread(parse, row.definition)
            except Exception as exc:
                raise Unreadable(workflow_id, exc) from exc
            self.put(workflow_id, dag, weight)
            return dag
        self._dags.move_to_end(workflow_id)
        return entry[0]

    def cached(self, workflow_id: int) -> graph.Dag | None:
        """``get``'s answer when it needs no read (None: it does)."""
        entry = self._dags.get(workflow_id)
        if entry is None:
            return None
        self._dags.move_to_end(workflow_id)
        return entry[0]

    def put(self, workflow_id: int, dag: graph.Dag, weight: int) -> None:
        if weight > self.max_bytes:
            return  # parsed again when needed, rather than holding more than the bound
        old = self._dags.pop(workflow_id, None)
        if old is not None:
            self.bytes -= old[1]
        self._dags[workflow_id] = (dag, weight)
        self.bytes += weight
        while len(self._dags) > self.size or self.bytes > self.max_bytes:
            _, (_, gone) = self._dags.popitem(last=False)
            self.bytes -= gone

    def __len__(self) -> int:
        return len(self._dags)


class Engine:
    """Runs the loop; ``wake()`` makes it look for new work at once."""

    def __init__(
        self, engine: AsyncEngine, settings: DagSettings, graphs: Graphs, database_url: str
    ) -> None:
        self.db = engine
        # The loop's reads, one statement each: no BEGIN before them, no ROLLBACK after
        # (two round trips of every read saved; each statement has its own snapshot, as
        # under READ COMMITTED it had).
        self.reads = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.elector = Elector(
            database_url, name="dag", key=_LEADER_KEY, table="dag.leader", poll_s=1.0
        )
        self.lease: Lease | None = None
        self.settings = settings
        self.graphs = graphs
        self.core = CoreClient(settings.cores, settings.token)
        self._wake = asyncio.Event()
        self._cursor: str | None = None
        self._full_page = False
        self.leading = False
        self.metrics = DagMetrics(lambda: self.leading)
        self._ended: list[RunState] = []
        self._purged_at = -math.inf
        self._resynced_at = -math.inf
        self._failed: list[tuple[Any, int]] = []  # (run, its newest node try) to notify
        self._waiting: list[tuple[Any, str, int]] = []  # (run, gate, its try) to notify
        self._written: dict[int, dict[str, Any] | None] = {}  # task id -> its outputs file
        self._to_deadline: float | None = None
        self._made = 0  # mapped instances made this turn
        self._readied = False  # a settle readied nodes (or made instances) to release
        self._cursor_stored_at = -math.inf  # when the cursor was last stored
        self._chored_at = -math.inf  # when the chores were last asked for (``step``)
        self._skipped = False  # this turn went without them
        self._starts: list[Event] = []  # start events read, not yet written (``apply``)
        #: the nodes of the tasks this loop released, by task id, newest last
        self._released: OrderedDict[int, _Released] = OrderedDict()
        #: workflow versions whose definition cannot be read: their runs were failed
        self._unreadable: set[int] = set()
        self._starts_due = math.inf  # when they are written even if no event follows
        self._polled_at = -math.inf  # when the read of the feed's last page was sent
        #: ready nodes the feed's apply read in its transaction, for ``release`` to take
        self._ready_rows: list[Any] = []

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        await self.core.aclose()

    # --- the loop --------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Lead (or wait to), then turn until cancelled. A failed turn is retried with
        backoff; the lease is checked before every turn (at most every
        ``_CHORES_EVERY_S``) and every write is fenced by its epoch, so a leader that lost
        its lock stops within a turn or two and writes nothing."""
        while True:
            lease = await self.elector.campaign()
            self.lease = lease
            self.leading = True
            try:
                await self._turn_forever(lease)
            except LeadershipLost as exc:
                log.warning("no longer leading the DAG loop: %s", exc)
            finally:
                self.leading = False
                self.lease = None
                self._reread()
                await lease.close()

    async def _turn_forever(self, lease: Lease) -> None:
        pause = self.settings.retry_base_s
        checked = -math.inf
        while True:
            if time.monotonic() - checked >= _CHORES_EVERY_S:
                await lease.check()
                checked = time.monotonic()
            try:
                await self._turn()
            except LeadershipLost:
                raise
            except Exception as exc:
                log.warning("a turn of the DAG loop failed, again in %.2f s: %r", pause, exc)
                self._reread()
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.settings.retry_cap_s)
            else:
                pause = self.settings.retry_base_s

    async def _turn(self) -> None:
        """``step``; one that met a workflow version whose definition cannot be read sets
        it aside (``set_aside``) and the next turn goes on at once. Met again on a path
        that does not skip it, it is a failed turn like any other (retried with backoff)."""
        try:
            await self.step()
        except Unreadable as exc:
            if exc.workflow_id in self._unreadable:
                raise
            await self.set_aside(exc)

    async def set_aside(self, exc: Unreadable) -> None:
        """Fail the open runs of a workflow version whose definition cannot be read (their
        live tasks cancelled in core by ``cancel_live``), and from now on apply no event
        to its nodes but the end of a task being cancelled. It failed every turn that met
        it, for ever, and so every event behind it, every other workflow's."""
        self._failed.clear()
        async with self._write() as conn:
            for run in await store.fail_unreadable(conn, exc.workflow_id, exc.why):
                nodes = await store.nodes_of(conn, [run.id])
                self._failed.append((run, max((n.try_number for n in nodes), default=0)))
        if len(self._unreadable) >= _UNREADABLE_KEPT:
            self._unreadable.clear()  # met again, each is set aside again
        self._unreadable.add(exc.workflow_id)
        log.error("%s; %d open runs of it failed", exc, len(self._failed))
        self.metrics.finished.labels(RunState.FAILED.value).inc(len(self._failed))
        await self._tell_failed()
        self._reread()  # the page it failed on is read again, without it

    def _leading(self) -> Lease:
        if self.lease is None:
            raise LeadershipLost("the DAG loop writes only while it leads")
        return self.lease

    @contextlib.asynccontextmanager
    async def _write(
        self, *, fenced: bool = True, durable: bool = True
    ) -> AsyncIterator[AsyncConnection]:
        """A write transaction of the leader, fenced by its epoch (``fenced=False``: the
        caller fences it itself, before anything it writes: ``Lease.fencing``).
        ``durable=False``: its commit does not wait for its WAL's flush
        (``_FEED_DURABLE``)."""
        lease = self._leading()
        told, read = len(self._waiting), len(self._ready_rows)
        try:
            async with self.db.begin() as conn:
                if fenced:
                    await lease.fence(conn, durable=durable)
                yield conn
        except BaseException:
            del self._waiting[told:]  # gates that did not start waiting after all
            del self._ready_rows[read:]  # nodes it did not ready after all
            raise

    async def step(self) -> None:
        """One turn: admit, release, cancel, then read and apply one page of the feed and
        release at once what it readied; now and then, purge runs past the retention.
        One query says which of the chores before the read have anything to do: asked at
        every turn something woke, else at most every ``_CHORES_EVERY_S`` (the read then
        waits no longer than the next time it is due)."""
        woken = self._wake.is_set()
        self._wake.clear()
        self._made = 0
        if time.monotonic() - self._purged_at > self.settings.retention_interval_s:
            await self.purge()
            self._purged_at = time.monotonic()
        due = None
        self._skipped = not woken and time.monotonic() - self._chored_at < _CHORES_EVERY_S
        if not self._skipped:
            due = await self._chores()
            self._chored_at = time.monotonic()
        if (
            time.monotonic() - self._resynced_at > self.settings.dag_resync_s
            and await self.resync() < self.settings.dag_resync_batch
        ):
            self._resynced_at = time.monotonic()  # else the next batch at the next turn
        page = await self._read()
        if page is not None:
            self._readied = False
            await self.apply(page)
            if self._readied:
                # The next nodes go to core now, before anything else: the hop's path.
                # (Releases still come before the next read: see the module's doc.)
                await self.release()
            if not self._full_page:
                self.metrics.caught_up()
        self.metrics.mapped.inc(self._made)
        await self._tell_waiting()
        if due is not None and due.audits:
            await self.report_decisions()

    async def _chores(self) -> Any:
        """Admit, time out, move gates and sub-workflow nodes on, release, cancel: each
        only if ``store.chores`` says it has something to do. What it said."""
        async with self.reads.connect() as conn:
            due = await store.chores(conn)
        self._to_deadline = None if due.to_deadline is None else max(0.0, float(due.to_deadline))
        if due.queued:
            await self.admit()
        if self._to_deadline == 0:
            await self.expire()
        if due.gates:
            await self.gates()
        if due.children:
            await self.children()
        if due.ready or due.queued or due.gates or due.children:
            await self.release()
        if due.cancelling:
            await self.cancel_live()
        return due

    def _reread(self) -> None:
        """Read the feed again from the stored cursor (the held starts with it)."""
        self._cursor = None
        self._starts = []
        self._ready_rows = []
        self._starts_due = math.inf

    async def _read(self) -> EventPage | None:
        if self._cursor is None:
            async with self.reads.connect() as conn:
                self._cursor = await store.read_cursor(conn)
        wait = 0 if self._full_page else self.settings.feed_wait_s
        if self._skipped:  # back when the chores are due again
            wait = min(wait, max(0.0, self._chored_at + _CHORES_EVERY_S - time.monotonic()))
        if self._to_deadline is not None:  # back in time to fail the next run that is due
            wait = min(wait, self._to_deadline + 0.01)
        if self._starts:  # back in time to write the held starts
            wait = min(wait, max(0.0, self._starts_due - time.monotonic()))
        # Held by core until a task ends (or ``_STARTS_HOLD_S``): a released task's
        # creation and start, which move the run on by nothing, wake no turn of their own.
        self._polled_at = time.monotonic()
        poll = asyncio.create_task(
            self.core.events(self._cursor, self.settings.feed_page, wait, _STARTS_HOLD_S)
        )
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

    async def purge(self) -> int:
        """Delete finished runs past the retention, one small fenced transaction a batch."""
        total = 0
        while True:
            async with self._write() as conn:
                gone = await store.purge_runs(conn, self.settings.retention_days * 86400, 500)
            total += gone
            if gone < 500:
                return total

    # --- admitting runs --------------------------------------------------------------------

    async def admit(self) -> None:
        async with self.reads.connect() as conn:
            queued = await store.queued_runs(conn)
        groups = {(r.owner, r.workflow) for r in queued}
        for owner, workflow in sorted(groups):
            async with self._write() as conn:
                most = await store.newest_max_active(conn, owner, workflow)
                for run in await store.admit(conn, owner, workflow, most):
                    await self._settle(conn, run, await store.nodes_of(conn, [run.id]))

    # --- run timeouts ----------------------------------------------------------------------

    async def expire(self) -> None:
        """Fail running runs past their deadline; their live tasks are cancelled next.
        One query a turn when none is due: how long until the next deadline."""
        async with self.reads.connect() as conn:
            self._to_deadline = await store.seconds_to_deadline(conn)
            if self._to_deadline is None or self._to_deadline > 0:
                return
            overdue = await store.overdue_runs(conn)
        self._failed.clear()
        for run_id in overdue:
            async with self._write() as conn:
                run = await store.time_out(conn, run_id)
                if run is not None:
                    nodes = await store.nodes_of(conn, [run_id])
                    self._failed.append((run, max((n.try_number for n in nodes), default=0)))
            if run is not None:
                log.info("run %s timed out", run_id, extra={"run_id": run_id})
                self.metrics.finished.labels(RunState.FAILED.value).inc()
                self.metrics.timed_out.inc()
        await self._tell_failed()
        async with self.reads.connect() as conn:
            self._to_deadline = await store.seconds_to_deadline(conn)

    # --- approval gates --------------------------------------------------------------------

    async def gates(self) -> None:
        """Move on the approval gates a person decided (the API records a decision once,
        on a waiting node) and decide those past their wait by their ``on_timeout``; then
        settle their runs. One query a turn when none is due."""
        async with self.reads.connect() as conn:
            due = await store.due_gates(conn)
        if not due:
            return
        self._failed.clear()
        for run_id in due:
            async with self._write() as conn:
                runs = await store.lock_runs(conn, [run_id])
                if not runs or runs[0].state != RunState.RUNNING:
                    continue  # an ended run's gates were cancelled with it
                run = runs[0]
                dag = await self.graphs.get(conn, run.workflow_id)
                nodes = await store.nodes_of(conn, [run_id], lock=True)
                defaults = {
                    n.name: (approval.on_timeout, approval.timeout_s)
                    for n in nodes
                    if n.state is N.WAITING
                    and n.name in dag.specs
                    and (approval := dag.specs[n.name].approval) is not None
                }
                await store.time_out_gates(conn, run_id, defaults)
                waited = await self._end_waits(conn, dag, run_id)
                if await store.apply_decisions(conn, run_id) or waited:
                    log.info("run %s: approval gates decided", run_id, extra={"run_id": run_id})
                    await self._settle(conn, run, await store.nodes_of(conn, [run_id], lock=True))
        await self._tell_failed()

    # --- sub-workflows ---------------------------------------------------------------------

    async def children(self) -> None:
        """End the sub-workflow nodes whose child run ended, as it did (with the outputs
        it kept), and settle their runs. One query a turn when none has."""
        async with self.reads.connect() as conn:
            due = await store.children_ended(conn)
        if not due:
            return
        self._ended.clear()
        self._failed.clear()
        for run_id in due:
            async with self._write() as conn:
                await self._child_ended(conn, run_id)
        for state in self._ended:
            self.metrics.finished.labels(state.value).inc()
        await self._tell_failed()

    async def _child_ended(self, conn: AsyncConnection, run_id: int) -> None:
        run = (await store.lock_runs(conn, [run_id]))[0]
        dag = await self.graphs.get(conn, run.workflow_id)
        nodes = await store.nodes_of(conn, [run_id], lock=True)
        live = [n for n in nodes if n.child_run_id is not None and n.state in _LIVE]
        kids = await store.child_runs(conn, [n.child_run_id for n in live if n.child_run_id])
        changes: dict[str, tuple[NodeState, str | None]] = {}
        kept: dict[str, dict[str, Any]] = {}
        for n in live:
            child = kids.get(n.child_run_id or 0)
            if child is None or child.state not in RUN_FINAL:
                continue
            if n.state is N.CANCELLING:
                changes[n.name] = (N.CANCELLED, None)
                continue
            state, error, outputs = await self._child_outcome(conn, dag.specs[n.name], child)
            changes[n.name] = (state, error)
            if outputs is not None:
                kept[n.name] = outputs
        await store.set_nodes(conn, run_id, changes)
        await store.set_outputs(conn, run_id, kept)
        if run.state == RunState.RUNNING and changes:
            current = [
                replace(n, state=changes.get(n.name, (n.state,))[0], outputs=kept.get(n.name))
                if n.name in changes
                else n
                for n in nodes
            ]
            await self._settle(conn, run, current)

    async def _child_outcome(
        self, conn: AsyncConnection, spec: NodeSpec, child: Any
    ) -> tuple[NodeState, str | None, dict[str, Any] | None]:
        """What a sub-workflow node ends as, after its child run ended: its state, why it
        failed, and the outputs it keeps (those its child's nodes kept, by name)."""
        if child.state == RunState.CANCELLED:
            return N.FAILED, f"its child run {child.id} was cancelled", None
        if child.state != RunState.SUCCEEDED:
            why = f": {child.reason}" if child.reason else ""
            return N.FAILED, f"its child run {child.id} failed{why}", None
        if not spec.outputs:
            return N.SUCCEEDED, None, None
        child_dag = await self.graphs.get(conn, child.workflow_id)
        found = data.collect(_kept_rows(await store.nodes_of(conn, [child.id])), child_dag.specs)
        written = {k: v for name in child_dag.order for k, v in found.get(name, {}).items()}
        outputs, error = data.kept_outputs(spec, written, {})
        if error is not None:
            error = error.replace("CAIRN_OUTPUTS", f"the outputs of child run {child.id}")
            return N.FAILED, error, outputs
        return N.SUCCEEDED, None, outputs

    async def _start_children(
        self,
        conn: AsyncConnection,
        run: Any,
        dag: graph.Dag,
        nodes: list[store.NodeRow],
        names: list[str],
        states: dict[str, NodeState],
    ) -> bool:
        """Start the child runs of these sub-workflow nodes the rules just readied (each
        runs while its child does). A node whose child cannot start fails, and the run's
        rules are applied again at once: False then (that settle has done the rest)."""
        tries = {n.name: n.try_number for n in nodes}
        outputs = data.collect(_kept_rows(nodes), dag.specs)
        renderer = Renderer(dag, RunContext(run.id, run.workflow, run.owner, run.params, outputs))
        failed = False
        for name in names:
            why = await self._start_child(conn, run, dag, renderer, name, tries)
            if why is not None:
                await store.fail_ready(conn, run.id, name, why)
                failed = True
        if failed:
            await self._settle(conn, run, await store.nodes_of(conn, [run.id], lock=True))
            return False
        states.update(dict.fromkeys(names, N.RUNNING))
        self._wake.set()  # a queued child to admit
        return True

    async def _start_child(
        self,
        conn: AsyncConnection,
        run: Any,
        dag: graph.Dag,
        renderer: Renderer,
        name: str,
        tries: Mapping[str, int],
    ) -> str | None:
        spec = dag.specs[name].workflow
        assert spec is not None
        if run.depth + 1 > MAX_SUBFLOW_DEPTH:
            return f"sub-workflows may nest at most {MAX_SUBFLOW_DEPTH} levels deep"
        row = await store.workflow_as_of(conn, run.owner, spec.name, spec.version, run.started_at)
        if row is None:
            which = f"version {spec.version} of " if spec.version else ""
            return f"no {which}workflow '{spec.name}' of {run.owner} when the run started"
        child = await self.graphs.get(conn, row.id)
        try:
            params = merged_params(child, renderer.child_params(name, tries[name]))
        except InvalidInput as exc:
            return f"the sub-workflow's {exc.detail}"
        definition = child.definition
        child_id = await store.start_child(
            conn, run, name, tries[name], row, params, child.order,
            definition.timeout_s, definition.max_active_nodes, definition.task_timeout_s,
        )  # fmt: skip
        log.info("run %s node %s: started child run %s", run.id, name, child_id)
        return None

    async def _end_waits(self, conn: AsyncConnection, dag: graph.Dag, run_id: int) -> int:
        """End the run's event nodes whose event came (they succeed with its data as
        their outputs) or whose wait is over (their ``on_timeout``); under the run's lock.
        How many ended."""
        ended: dict[str, tuple[NodeState, str | None, dict[str, Any] | None]] = {}
        for row in await store.event_waits(conn, run_id):
            spec = dag.specs[row.name]
            if spec.event is None:
                continue
            if row.data is not None:
                kept, why = data.kept_outputs(spec, row.data, {})
                ended[row.name] = (N.FAILED if why else N.SUCCEEDED, why, kept)
            elif row.due:
                on = spec.event.on_timeout
                why = f"no event '{spec.event.name}' within {spec.event.timeout_s} s"
                ended[row.name] = (
                    (N.SUCCEEDED, None, None) if on == "succeed" else (N.FAILED, why, None)
                )
        done = await store.end_waits(conn, run_id, ended)
        if done:
            log.info("run %s: event nodes %s ended", run_id, done, extra={"run_id": run_id})
        return len(done)

    # --- applying the feed -----------------------------------------------------------------

    async def _fetch_outputs(
        self, events: list[Event], nodes: list[Any]
    ) -> dict[int, dict[str, Any] | None]:
        """The outputs files of the tasks these events say succeeded, for the nodes that
        declare values from one (``nodes``: ``store.nodes_of_tasks``; read from core's
        attempt, before the transaction)."""
        succeeded = {e.task_id: e.attempt_id for e in events if e.to_state is TaskState.SUCCEEDED}
        if not succeeded:
            return {}
        ended = [row for row in nodes if row.task_id in succeeded]
        dags = await self._dags({row.workflow_id for row in ended})
        wanted = [
            row.task_id
            for row in ended
            if data.needs_file(dags[row.workflow_id].specs[row.map_of or row.name])
        ]
        if not wanted:
            return {}
        gate = asyncio.Semaphore(_OUTPUT_FETCHES)

        async def written(task_id: int) -> dict[str, Any] | None:
            async with gate:
                try:
                    attempts = await self.core.attempts(task_id)
                except NotFound:  # gone from core: the node keeps no values from it
                    return None
            return next((a.outputs for a in attempts if a.id == succeeded[task_id]), None)

        found = await asyncio.gather(*(written(t) for t in wanted))
        return dict(zip(wanted, found, strict=True))

    async def _dags(self, workflow_ids: set[int]) -> dict[int, graph.Dag]:
        """The parsed definitions of these workflow versions, a read connection checked
        out only for those not cached (none at a workflow hop: two checkouts a hop were
        for nothing)."""
        found = {w: dag for w in workflow_ids if (dag := self.graphs.cached(w)) is not None}
        if len(found) < len(workflow_ids):
            async with self.reads.connect() as conn:
                for w in workflow_ids - found.keys():
                    found[w] = await self.graphs.get(conn, w)
        return found

    async def apply(self, page: EventPage) -> None:
        """Apply one page to the nodes whose tasks it names, and store its cursor, in one
        transaction. A page whose only moves are starts is held (its cursor not stored)
        and written with the next page, until ``_STARTS_HOLD_S`` after the read that
        brought it was sent: a short task's start and end then cost one transaction, not
        two. Core holds such a page that long already (``hold``), unless the read's
        ``wait`` was shorter: the loop holds it only for the rest, not a second time."""
        events = [*self._starts, *page.items]
        moves = [e for e in events if e.to_state in _MOVES]
        due = min(self._starts_due, self._polled_at + _STARTS_HOLD_S)
        if moves and all(e.to_state is TaskState.RUNNING for e in moves) and time.monotonic() < due:
            self._starts = moves
            self._starts_due = due
            self._cursor = page.next_cursor
            return
        await self._apply_events(events, page.next_cursor)
        self._starts = []
        self._starts_due = math.inf
        self._cursor = page.next_cursor

    async def _apply_events(
        self, events: list[Event], cursor: str | None, errors: Mapping[int, str] | None = None
    ) -> None:
        """Apply task events to the nodes waiting on those tasks (and store the feed's
        cursor, if given) in one transaction. ``errors``: why a node whose task it names
        fails, instead of how the task ended."""
        by_task: dict[int, list[Event]] = defaultdict(list)
        for event in events:
            if event.to_state in _MOVES:  # the others move no node
                by_task[event.task_id].append(event)
        self._ended.clear()
        self._failed.clear()
        mine = await self._apart(await self._nodes_of_tasks(by_task), by_task)
        if not mine:
            await self._skip_to(cursor)  # none of this page's events moves a node
            return
        run_ids = sorted({row.run_id for row in mine})
        if not any(e.to_state in FINAL for row in mine for e in by_task[row.task_id]):
            # Only starts (released -> running): no rule reads them, nothing to settle.
            async with self._write(durable=_FEED_DURABLE) as conn:
                await store.lock_runs(conn, run_ids)
                await store.mark_running(conn, [row.task_id for row in mine])
                await self._store_cursor(conn, cursor)
            return
        self._written = await self._fetch_outputs(events, mine)
        async with self._write(fenced=False) as conn:
            lease = self._leading()
            few = await self._few_nodes(conn, mine)
            # The fence, the runs' locks and their nodes in one round trip. The nodes are
            # read without a lock: every writer of a running run's nodes either holds its
            # run's lock first (this loop, a cancel) or writes only on a condition this
            # transaction does not change (a release recorded, a gate decided); a retry
            # or a clear takes a finished run's nodes and then its run. Locking each node
            # too wrote a lock on every node of the run at every hop, for nothing. Of a run
            # whose rules settle locally only the nodes the ended ones can move are read
            # (``_few_nodes``), and whether any other node is still open.
            # The cursor is written in the same round trip (the transaction's writes commit
            # together, whatever their order).
            fence, runs, nodes, open_elsewhere = await store.locked_with_some_nodes(
                conn, run_ids, few, lease.fencing(durable=_FEED_DURABLE), self._cursor_write(cursor)
            )
            lease.fenced(fence[0].epoch if fence else None)
            per_run: dict[int, list[store.NodeRow]] = defaultdict(list)
            for node in nodes:
                per_run[node.run_id].append(node)
            for i, run in enumerate(runs):
                some = None if run.id not in few else run.id in open_elsewhere
                last = i == len(runs) - 1  # nothing follows its writes in the transaction
                await self._apply_run(conn, run, per_run[run.id], by_task, errors or {}, some, last)
        for task_id, said in by_task.items():
            if any(e.to_state in FINAL for e in said):
                self._released.pop(task_id, None)  # its node reads no more of it
        for state in self._ended:
            self.metrics.finished.labels(state.value).inc()
        await self._tell_failed()

    async def _apart(self, mine: list[Any], by_task: Mapping[int, list[Event]]) -> list[Any]:
        """``mine`` without the nodes of workflow versions set aside: of those only a
        cancelling node whose task ended is written (cancelled; ``set_aside``)."""
        if not self._unreadable:
            return mine
        ended = [
            row.task_id
            for row in mine
            if row.workflow_id in self._unreadable
            and any(e.to_state in FINAL for e in by_task[row.task_id])
        ]
        if ended:
            async with self._write() as conn:
                for task_id in ended:
                    await store.cancelled(conn, task_id)
        return [row for row in mine if row.workflow_id not in self._unreadable]

    async def _few_nodes(self, conn: AsyncConnection, mine: list[Any]) -> dict[int, set[str]]:
        """The nodes to read of each run whose rules settle locally (``Dag.settles_locally``):
        those whose tasks the page names, the nodes right below them and the upstream nodes
        of those (what their rules read). Every other pending node of a running run already
        waits on an upstream node not ended (each change of a running run's nodes is
        settled in its own transaction), and only a node that ends changes what a rule of
        the nodes right below it says."""
        few: dict[int, set[str]] = {}
        local: dict[int, bool] = {}
        for row in mine:
            if row.run_id in local and not local[row.run_id]:
                continue
            dag = await self.graphs.get(conn, row.workflow_id)
            local[row.run_id] = dag.settles_locally and row.name in dag.specs
            if not local[row.run_id]:
                few.pop(row.run_id, None)
                continue
            names = few.setdefault(row.run_id, set())
            names.add(row.name)
            for below in dag.downstream[row.name]:
                names.add(below)
                names.update(dag.upstream[below])
        return few

    async def _nodes_of_tasks(self, task_ids: Iterable[int]) -> list[Any]:
        """The nodes of these tasks with their runs' workflow versions: those this loop
        released from memory (a task's node never changes), the others read."""
        ids = list(task_ids)
        known: list[Any] = [self._released[t] for t in ids if t in self._released]
        unknown = [t for t in ids if t not in self._released]
        if unknown:
            async with self.reads.connect() as conn:
                known += await store.nodes_of_tasks(conn, unknown)
        return known

    def _cursor_write(self, cursor: str | None) -> list[Any]:
        """The cursor's write (none for None), to send with a transaction's first
        statements (``pipeline.run``)."""
        if cursor is None:
            return []
        self._cursor_stored_at = time.monotonic()
        return [store.cursor_stored(cursor)]

    async def _store_cursor(self, conn: AsyncConnection, cursor: str | None) -> None:
        if cursor is not None:
            await store.store_cursor(conn, cursor)
            self._cursor_stored_at = time.monotonic()

    async def _skip_to(self, cursor: str | None) -> None:
        """A page that moves no node: its cursor is stored at most once a
        ``_CURSOR_EVERY_S`` (what a restart reads again meanwhile moves nothing either;
        the next page that moves a node stores it in its own transaction)."""
        if cursor is not None and time.monotonic() - self._cursor_stored_at >= _CURSOR_EVERY_S:
            async with self._write(durable=_FEED_DURABLE) as conn:
                await self._store_cursor(conn, cursor)

    async def _apply_run(
        self,
        conn: AsyncConnection,
        run: Any,
        nodes: list[store.NodeRow],
        by_task: dict[int, list[Event]],
        errors: Mapping[int, str],
        open_elsewhere: bool | None = None,
        last: bool = False,
    ) -> None:
        """Apply the events to the run's nodes and settle it. ``open_elsewhere``: None if
        ``nodes`` are all the run's nodes, else whether a node not in them is open.
        ``last``: nothing follows in the caller's transaction (``_settle_few``)."""
        changes: dict[str, tuple[NodeState, str | None]] = {}
        kept: dict[str, dict[str, Any]] = {}
        dag = await self.graphs.get(conn, run.workflow_id)
        for node in nodes:
            if node.task_id is None or node.task_id not in by_task:
                continue
            state = node.state
            for event in by_task[node.task_id]:
                state = _after_event(node, state, event) or state
            if state is node.state:
                continue
            error = (
                errors.get(node.task_id)
                or f"task {node.task_id} ended {by_task[node.task_id][-1].to_state}"
                if state is N.FAILED
                else None
            )
            if state is N.SUCCEEDED and dag.specs[node.map_of or node.name].outputs:
                kept[node.name], error = self._kept(dag, run, node)
                state = N.FAILED if error else state
            changes[node.name] = (state, error)
        await store.set_outputs(conn, run.id, kept)
        if run.state != RunState.RUNNING or not changes:
            await store.set_nodes(conn, run.id, changes)
            return

        def current(nodes: list[store.NodeRow]) -> list[store.NodeRow]:
            return [
                replace(n, state=changes[n.name][0], outputs=kept.get(n.name, n.outputs))
                if n.name in changes
                else n
                for n in nodes
            ]

        if open_elsewhere is not None:
            few = current(nodes)
            if await self._settle_few(conn, run, dag, few, changes, open_elsewhere, last):
                return
            nodes = await store.nodes_of(conn, [run.id])  # the rules need the whole run
        await self._settle(conn, run, current(nodes), changes)  # it writes them with its own

    async def _settle_few(
        self,
        conn: AsyncConnection,
        run: Any,
        dag: graph.Dag,
        nodes: list[store.NodeRow],
        written: Mapping[str, tuple[NodeState, str | None]],
        open_elsewhere: bool,
        last: bool = False,
    ) -> bool:
        """``_settle`` over the nodes ``_few_nodes`` read, when what the ended ``written``
        nodes change is only nodes right below them made ready, to be released, and the run
        goes on: then write it all and return True. Else (a node below skipped or failed
        upstream, which flows further down; an approval, an event or a sub-workflow node
        readied; the run may be ending) write nothing and return False: the caller settles
        over every node. ``last``: nothing follows in the transaction, whose COMMIT then
        goes with the nodes' write and read (a round trip fewer on the hop's path)."""
        if not open_elsewhere:
            return False
        states = {n.name: n.state for n in nodes}
        below = {d for name in written for d in dag.downstream[name]}
        order = [name for name in dag.order if name in below]
        now = rules.settle(order, dag.upstream, {n: dag.rule(n) for n in order}, states)
        if any(state is not N.READY for state in now.values()):
            return False
        gates, waits, children = _not_released(dag, now)
        if gates or waits or children:
            return False
        changes = {name: (state, None) for name, state in now.items()}
        if not now:
            await store.set_nodes(conn, run.id, {**written, **changes})
            return True
        # Read what it readied in the same round trip: released once this commits.
        self._ready_rows += await store.set_nodes_reading_ready(
            conn, run.id, {**written, **changes}, MAX_BATCH, commit=last
        )
        self._readied = True
        self._wake.set()
        return True

    def _kept(
        self, dag: graph.Dag, run: Any, node: store.NodeRow
    ) -> tuple[dict[str, Any], str | None]:
        """What a node whose task succeeded keeps as its outputs, or why it fails."""
        spec_name = node.map_of or node.name
        instance = None if node.map_index is None else data.Instance(node.map_index, node.map_item)
        context = RunContext(run.id, run.workflow, run.owner, run.params)
        paths = Renderer(dag, context).paths(spec_name, node.try_number, instance)
        written = self._written.get(node.task_id) if node.task_id is not None else None
        return data.kept_outputs(dag.specs[spec_name], written, paths)

    async def _settle(
        self,
        conn: AsyncConnection,
        run: Any,
        nodes: list[store.NodeRow],
        written: Mapping[str, tuple[NodeState, str | None]] | None = None,
    ) -> None:
        """Apply the trigger rules to a running run's pending nodes; end it if all ended.
        ``written``: node changes the caller made in ``nodes`` (not stored yet), stored in
        the same statement as the rules' own."""
        dag = await self.graphs.get(conn, run.workflow_id)
        states = {n.name: n.state for n in nodes}
        instances = _instances(nodes)
        rule_of = {n: dag.rule(n) for n in dag.order}
        changed: dict[str, NodeState] = {}
        errors: dict[str, str] = {}
        expanded = False
        while True:
            now = rules.settle(dag.order, dag.upstream, rule_of, states, instances)
            ready = [n for n, s in now.items() if s is N.READY]
            gated = {n: dag.conditions[n] for n in ready if n in dag.conditions}
            mapped = [n for n in ready if dag.specs[n].map is not None]
            if not gated and not mapped:
                changed.update(now)
                break
            outputs = data.collect(_kept_rows(nodes), dag.specs)
            all_wait = _branch(gated, states, run.params, outputs, now, errors)
            changed.update(now)
            mapped = [n for n in mapped if states[n] is N.READY]  # not skipped, not waiting
            if all_wait and not mapped:
                break  # nothing ended that the rules have not seen
            tries = {n.name: n.try_number for n in nodes}
            for name in mapped:
                items, why = data.map_items(dag.specs[name], run.params, outputs)
                if why is not None or not items:  # an empty list skips it, as in Airflow
                    states[name] = changed[name] = N.FAILED if why else N.SKIPPED
                    errors[name] = why or "map.over is an empty list"
                    continue
                del changed[name]
                instances[name] = await store.expand(conn, run.id, name, tries[name], items)
                self._made += len(items)  # counted once the turn's transactions committed
                states[name] = N.MAPPED
                states.update(dict.fromkeys(instances[name], N.READY))
                expanded = True
        # An approval gate whose rule is met waits for a person instead of a release, an
        # event node for its event; a sub-workflow node starts a child run.
        gates, waits, children = _not_released(dag, changed)
        for name in [*gates, *waits]:
            states[name] = changed[name] = N.WAITING
        await store.set_nodes(
            conn,
            run.id,
            {
                **(written or {}),
                **{name: (state, errors.get(name)) for name, state in changed.items()},
            },
        )
        await store.start_waiting(conn, run.id, gates)
        await store.wait_for_events(conn, run.id, waits)
        tries = {n.name: n.try_number for n in nodes}
        self._waiting += [(run, name, tries.get(name, 1)) for name in gates]
        if children and not await self._start_children(conn, run, dag, nodes, children, states):
            return
        outcome = await self._end_if_done(conn, run, dag, nodes, states)
        if expanded or N.READY in changed.values():
            self._readied = True
        if expanded or gates or waits or N.READY in changed.values() or outcome is not None:
            # New work for the releaser, or room for a queued run of this workflow (or a
            # gate's or an event node's timeout for the loop to wait for).
            self._wake.set()

    async def _end_if_done(
        self,
        conn: AsyncConnection,
        run: Any,
        dag: graph.Dag,
        nodes: list[store.NodeRow],
        states: Mapping[str, NodeState],
    ) -> RunState | None:
        """End the run if its leaves say how; its outcome (None: it goes on)."""
        outcome = rules.run_outcome(dag.leaves, states)
        if outcome is not None:
            await store.finish_run(conn, run.id, outcome)
            self._ended.append(outcome)
            if outcome is RunState.FAILED:
                self._failed.append((run, max((n.try_number for n in nodes), default=0)))
        return outcome

    # --- anti-entropy -----------------------------------------------------------------------

    async def resync(self) -> int:
        """Read from core the tasks of up to ``CAIRN_DAG_RESYNC_BATCH`` nodes released,
        running or cancelling and unchanged for ``CAIRN_DAG_RESYNC_S``, and apply what they
        say as their feed events would: a final task's outcome (outputs included); a task
        gone from core (its retention purged it before its outcome was read) fails the node,
        so its run's rules go on. A task still live touches its node only (not checked again
        for an interval). The writes are the feed's: fenced, under the run's lock, and only
        to a node still live on that very task, so a feed event for it, before or after, is
        a no-op. Returns how many nodes it checked."""
        async with self.reads.connect() as conn:
            stale = await store.stale_nodes(
                conn, self.settings.dag_resync_s, self.settings.dag_resync_batch
            )
        if not stale:
            return 0
        gate = asyncio.Semaphore(_OUTPUT_FETCHES)

        async def read(task_id: int) -> Task | None:
            async with gate:
                try:
                    return await self.core.get_task(task_id)
                except NotFound:
                    return None

        task_ids = [row.task_id for row in stale]
        found = await asyncio.gather(*(read(t) for t in task_ids))
        events: list[Event] = []
        errors: dict[int, str] = {}
        live: list[int] = []
        for task_id, task in zip(task_ids, found, strict=True):
            if task is None:
                events.append(_gone(task_id))
                errors[task_id] = (
                    f"its task {task_id} is gone from core (purged before its outcome was read)"
                )
            else:
                events.append(_as_event(task))
                if task.state not in FINAL:
                    live.append(task_id)
        if len(live) < len(stale):
            log.info(
                "resync: of %d nodes checked, %d had a task ended unseen, %d a task gone",
                len(stale), len(stale) - len(live) - len(errors), len(errors),
            )  # fmt: skip
        await self._apply_events(events, None, errors)
        if live:
            async with self._write() as conn:
                await store.touch_live(conn, live)
        return len(stale)

    # --- releasing ready nodes -------------------------------------------------------------

    async def release(self) -> None:
        """Submit every ready node's task and record its id. Batches are cut by encoded
        size; a run whose batch core could not take now (unreachable, 5xx, rate limited)
        waits for the next turn without holding up any other run."""
        held: set[int] = set()
        # What the feed's apply readied, read in its transaction (``_settle_few``), goes
        # first, without a read of its own; other runs' ready nodes on the next turn (the
        # apply woke it), or right after them if they filled a batch.
        read, self._ready_rows = self._ready_rows[:MAX_BATCH], []
        while True:
            read_at = time.monotonic()
            if not read:
                async with self.reads.connect() as conn:
                    read_at = time.monotonic()
                    read = await store.ready_nodes(conn, MAX_BATCH, sorted(held))
            ready = read
            if not ready:
                return
            specs = await self._render(ready)
            by_owner: dict[str, list[tuple[Any, TaskCreate]]] = defaultdict(list)
            for row in ready:
                spec = specs.get((row.run_id, row.name))
                if spec is not None:
                    by_owner[row.owner].append((row, spec))
            for owner, items in by_owner.items():
                for chunk in by_size(items, self.settings.release_batch_bytes):
                    try:
                        await self._submit(owner, chunk, read_at)
                    except (CairnError, httpx.TransportError) as exc:
                        runs = {row.run_id for row, _ in chunk}
                        log.warning("releasing runs %s waits for core: %r", sorted(runs), exc)
                        held |= runs
            if len(ready) < MAX_BATCH:
                return
            read = []

    async def _render(self, ready: list[Any]) -> dict[tuple[int, str], TaskCreate]:
        specs: dict[tuple[int, str], TaskCreate] = {}
        dags = await self._dags({row.workflow_id for row in ready})
        # Only a run whose definition declares outputs has any kept (or any to collect).
        keeping = {row.run_id for row in ready if dags[row.workflow_id].keeps_outputs}
        kept: dict[int, Any] = {}
        if keeping:
            async with self.reads.connect() as conn:
                kept = await store.outputs_of(conn, keeping)
        outputs: dict[int, Mapping[str, Mapping[str, Any]]] = {}
        for row in ready:
            dag = dags[row.workflow_id]
            if row.run_id not in outputs:
                outputs[row.run_id] = data.collect(_kept_rows(kept.get(row.run_id, [])), dag.specs)
            context = RunContext(
                row.run_id,
                row.workflow,
                row.owner,
                row.params,
                outputs[row.run_id],
                task_timeout_s=row.task_timeout_s,
            )
            instance = None if row.map_of is None else data.Instance(row.map_index, row.map_item)
            try:
                specs[(row.run_id, row.name)] = Renderer(dag, context).task(
                    row.map_of or row.name, row.try_number, instance
                )
            except InvalidInput as exc:
                await self._refused(row, exc)
        return specs

    async def _submit(
        self, owner: str, items: list[tuple[Any, TaskCreate]], read_at: float
    ) -> None:
        start = tracing.now_ns()
        tasks = await self._send(owner, items)
        task_ids = [task_id for task_id, _ in tasks]
        traces.released([row for row, _ in items], tasks, start)
        released = [
            (row.run_id, row.name, row.try_number, task_id)
            for (row, _), task_id in zip(items, task_ids, strict=True)
            if task_id
        ]
        async with self._write(fenced=False) as conn:
            lease = self._leading()
            fence, recorded = await store.record_released(
                conn, released, lease.fencing(durable=_FEED_DURABLE), lease.epoch
            )
            lease.fenced(fence[0].epoch if fence else None)
        ids = {(run_id, name): task_id for run_id, name, _, task_id in released}
        for row, _ in items:
            task_id = ids.get((row.run_id, row.name), 0)
            if task_id in recorded:
                self._remember(
                    _Released(row.run_id, row.name, row.map_of, task_id, row.workflow_id)
                )
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

    def _remember(self, node: _Released) -> None:
        self._released[node.task_id] = node
        while len(self._released) > _RELEASED_KEPT:
            self._released.popitem(last=False)

    async def _send(
        self, owner: str, items: list[tuple[Any, TaskCreate]]
    ) -> list[tuple[int, datetime | None]]:
        """The task id (and creation time) of each item in order, 0 where core refused the
        node's task: a refused batch is halved until the refusal names one node, which
        alone fails."""
        try:
            if len(items) == 1:
                task, _ = await self.core.submit(items[0][1], on_behalf_of=owner)
                return [(task.id, task.created_at)]
            answers = await self.core.submit_batch([spec for _, spec in items], on_behalf_of=owner)
            return [(answer.id, answer.created_at) for answer in answers]
        except CairnError as exc:
            if not is_refusal(exc):
                raise
            if len(items) == 1:
                await self._refused(items[0][0], exc)
                return [(0, None)]
        half = len(items) // 2
        return await self._send(owner, items[:half]) + await self._send(owner, items[half:])

    async def _refused(self, row: Any, exc: CairnError) -> None:
        log.info(
            "run %s node %s refused: %s",
            row.run_id,
            row.name,
            exc.detail,
            extra={"run_id": row.run_id},
        )
        self._failed.clear()
        async with self._write() as conn:
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

    async def _tell_waiting(self) -> None:
        """Post the approval gates that started waiting (committed) to core, for their
        runs' owners' ``approval.waiting`` webhooks. Best effort, as ``_tell_failed``;
        core queues one delivery per gate's try whatever is posted again."""
        waiting, self._waiting = self._waiting, []
        for run, name, try_number in waiting:
            path = f"/v1/runs/{run.id}/nodes/{name}"
            event = NotificationEvent(
                event="approval.waiting",
                owner=run.owner,
                key=f"run {run.id} node {name} try {try_number}",
                summary=f"workflow {run.workflow} run {run.id}: {name} waits for approval",
                subject={
                    "run_id": str(run.id),
                    "workflow": run.workflow,
                    "node": name,
                    "approve": f"{path}/approve",
                    "reject": f"{path}/reject",
                },
            )
            try:
                await self.core.notify(event)
            except Exception as exc:  # whatever it is, the gate waits all the same
                log.warning("run %s: notification not posted: %s", run.id, exc)

    async def report_decisions(self) -> int:
        """Report the approval decisions not yet in core's audit trail (``dag.approve``,
        ``dag.reject``, by the person, or by the service when a timeout decided), oldest
        first; each is marked once core took it, so a decision is reported at least once,
        and recorded once: a report sent again (a timeout, the loop stopped before the
        mark) carries the same idempotency key (``decision_key``). Returns how many."""
        async with self.reads.connect() as conn:
            pending = await store.pending_audits(conn)
        for row in pending:
            report = AuditReport(
                action=f"dag.{row.decision}",
                target=f"run:{row.run_id}/node:{row.name}",
                actor=row.decided_by,
                actor_role=row.decided_role if row.decided_role in _ROLES else None,
                after={
                    "workflow": row.workflow,
                    "owner": row.owner,
                    "try": row.try_number,
                    "decision": row.decision,
                    "comment": row.comment,
                    "by_timeout": row.decided_by is None,
                    "decided_at": row.decided_at.isoformat(),
                },
                idempotency_key=decision_key(row.run_id, row.name, row.try_number, row.decided_at),
            )
            try:
                await self.core.report_audit(report)
            except CairnError as exc:
                if not is_refusal(exc):
                    log.warning("approval decisions wait to be audited: %r", exc)
                    return 0
                log.error("core refused the audit report %s: %s", report, exc.detail)
            except httpx.TransportError as exc:
                log.warning("approval decisions wait to be audited: %r", exc)
                return 0
            async with self._write() as conn:
                await store.audited(conn, row.run_id, row.name, row.decided_at)
        return len(pending)

    # --- cancelling ------------------------------------------------------------------------

    async def cancel_live(self) -> None:
        """Cancel in core what cancelled runs still have there: recorded tasks by id, and
        for nodes whose release was never recorded, whatever their key submitted."""
        async with self.reads.connect() as conn:
            live = await store.cancelling_nodes(conn, MAX_BATCH)
        untracked: dict[str, list[Any]] = defaultdict(list)
        for row in live:
            if row.child_run_id is not None:
                async with self._write() as conn:
                    why = f"its parent run {row.run_id} ended before it (node {row.name})"
                    await store.cancel_child(conn, row.child_run_id, why)
                    await store.close_cancelled_child(conn, row.run_id, row.name)
                self._wake.set()  # the child's own live nodes to cancel
            elif row.task_id is None:
                untracked[row.owner].append(row)
            elif await self._cancel_task(row.task_id):
                async with self._write() as conn:
                    await store.cancelled(conn, row.task_id)
        for owner, rows in untracked.items():
            for at in range(0, len(rows), _KEYS_PER_LOOKUP):
                await self._cancel_by_key(owner, rows[at : at + _KEYS_PER_LOOKUP])

    async def _cancel_by_key(self, owner: str, rows: list[Any]) -> None:
        keys = [release_key(r.run_id, r.name, r.try_number) for r in rows]
        page = await self.core.list_tasks(owner=owner, idempotency_keys=keys, limit=len(keys))
        for task in page.items:
            await self._cancel_task(task.id)
        async with self._write() as conn:
            await store.cancelled_untracked(conn, [(r.run_id, r.name) for r in rows])

    async def _cancel_task(self, task_id: int) -> bool:
        """Ask core to cancel; False when the task had already ended (its event will say
        how)."""
        try:
            await self.core.cancel(task_id)
        except (Conflict, NotFound):
            return False
        return True


def _as_event(task: Task) -> Event:
    """A task's current state as the event that would have brought it there."""
    return Event(
        cursor="",
        task_id=task.id,
        seq=0,
        owner=task.owner,
        op="resync",
        from_state=None,
        to_state=task.state,
        reason=task.last_error,
        attempt_id=task.current_attempt_id,
        at=task.finished_at or task.updated_at,
    )


def _gone(task_id: int) -> Event:
    """What stands for a task gone from core: it ended, how is unknown (a ``cancelled``
    event fails a live node and closes a cancelling one)."""
    return Event(
        cursor="",
        task_id=task_id,
        seq=0,
        owner="",
        op="resync",
        from_state=None,
        to_state=TaskState.CANCELLED,
        reason="gone from core",
        attempt_id=None,
        at=datetime.now(UTC),
    )


def by_size(items: list[tuple[Any, TaskCreate]], limit: int) -> list[list[tuple[Any, TaskCreate]]]:
    """``items`` cut into runs whose encoded specs stay under ``limit`` bytes (an item
    larger than that goes alone: core says whether it takes it). One item goes alone
    whatever its size: it is not encoded to be measured (the client encodes it to send)."""
    if len(items) <= 1:
        return [list(items)] if items else []
    chunks: list[list[tuple[Any, TaskCreate]]] = []
    size = limit + 1
    for item in items:
        n = len(item[1].model_dump_json()) + 1
        if size + n > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += n
    return chunks


def _instances(nodes: Iterable[store.NodeRow]) -> dict[str, list[str]]:
    """The instances of each mapped node, in index order."""
    found: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for n in nodes:
        if n.map_of is not None:
            found[n.map_of].append((n.map_index or 0, n.name))
    return {node: [name for _, name in sorted(items)] for node, items in found.items()}


def _branch(
    gated: Mapping[str, conditions.Condition],
    states: dict[str, NodeState],
    params: Mapping[str, Any],
    outputs: Mapping[str, Mapping[str, Any]],
    now: dict[str, NodeState],
    errors: dict[str, str],
) -> bool:
    """Decide the branches among the nodes ``now`` made ready, in the transaction that
    readies them: each stays ready, is skipped or fails (``errors`` says why), or goes
    back to pending (out of ``now``) while a node it reads has not ended. True if every
    one waits."""
    decided = conditions.decide(gated, states, params, outputs)
    for name, (state, why) in decided.items():
        states[name] = state
        if state is N.PENDING:
            del now[name]
        elif state is not N.READY:
            now[name], errors[name] = state, why or ""
    return all(state is N.PENDING for state, _ in decided.values())


def _not_released(
    dag: graph.Dag, changed: Mapping[str, NodeState]
) -> tuple[dict[str, int], dict[str, tuple[str, int]], list[str]]:
    """Of the nodes the rules just readied, those that are not released to core: the
    approval gates (they wait for a person; with their timeouts), the event nodes (they
    wait for their event; its name and their timeouts) and the sub-workflow nodes (they
    start a child run)."""
    gates: dict[str, int] = {}
    waits: dict[str, tuple[str, int]] = {}
    children: list[str] = []
    for name, state in changed.items():
        spec = dag.specs.get(name)
        if state is not N.READY or spec is None:
            continue
        if spec.approval is not None:
            gates[name] = spec.approval.timeout_s
        elif spec.event is not None:
            waits[name] = (spec.event.name, spec.event.timeout_s)
        elif spec.workflow is not None:
            children.append(name)
    return gates, waits, children


def _kept_rows(nodes: Iterable[store.NodeRow]) -> list[data.Kept]:
    return [data.Kept(n.name, n.map_of, n.map_index, n.outputs) for n in nodes]


def clear_set(dag: graph.Dag, node: str, downstream: bool) -> list[str]:
    """The nodes a clear runs again: ``node`` and, unless told not to, all below it."""
    cleared = {node}
    if downstream:
        for name in dag.order:
            if any(up in cleared for up in dag.upstream[name]):
                cleared.add(name)
    return sorted(cleared)


def reset_for_retry(dag: graph.Dag, states: dict[str, NodeState]) -> list[str]:
    """The nodes a retry runs again: those that failed, could not run or were cancelled,
    and every skipped node below them (its rule may be met this time). A mapped node runs
    again whole (instances are not nodes of the definition)."""
    again = {
        n
        for n, s in states.items()
        if s in (N.FAILED, N.UPSTREAM_FAILED, N.CANCELLED) and n in dag.specs
    }
    for name in dag.order:
        if states[name] is N.SKIPPED and any(up in again for up in dag.upstream[name]):
            again.add(name)
    return sorted(again)


def failed_instances(
    again: Iterable[str], nodes: Iterable[store.NodeRow]
) -> tuple[list[str], list[str]]:
    """Of the mapped nodes a retry would run again whole, those with instances keep the
    ones that succeeded: returns (mapped nodes that map no more, their instances to run
    again). A mapped node that never expanded is left to run again whole."""
    again = set(again)
    mapped: set[str] = set()
    instances = []
    for n in nodes:
        if n.map_of in again:
            mapped.add(n.map_of)
            if n.state in (N.FAILED, N.UPSTREAM_FAILED, N.CANCELLED):
                instances.append(n.name)
    return sorted(mapped), sorted(instances)


def open_nodes(states: Iterable[NodeState]) -> int:
    return sum(1 for s in states if s not in NODE_FINAL)
