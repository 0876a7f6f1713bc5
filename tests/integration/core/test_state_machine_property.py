"""Random sequences of state changes against a real PostgreSQL, checked against a model.

Hypothesis drives the store (``services.core.db.tasks``) with any op to any target, legal or
not, plus cancels, retries, pausing and resuming queues, moving ``run_at`` and promoter
passes. A legal move must land; an illegal one must raise ``IllegalTransition`` and change
nothing. After every step each task's stored state must match the model and its event
history must replay: from nothing, through pairs the table allows, to the stored state,
with ``seq`` counting 1..n and equal to ``tasks.version``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from libs.common.auth import Visibility
from libs.common.errors import IllegalTransition, NotFound
from libs.common.models import TaskCreate
from libs.common.states import FINAL, TaskState
from services.core.db import tasks as tasks_db
from services.core.domain.transitions import ALLOWED, TRANSITIONS, Op

S = TaskState
T = TypeVar("T")
OWNER = "alice"
QUEUES = ("alpha", "beta")
FUTURE = datetime(2999, 1, 1, tzinfo=UTC)
MAX_TASKS = 8
OWNERS = st.sampled_from([OWNER, OWNER, OWNER, "bob"])
WORKER_OPS = [op for op in Op if op not in (Op.CANCEL, Op.RETRY)]
SUBMISSIONS = st.tuples(st.sampled_from(QUEUES), st.booleans())

# Each example starts from no tasks, events or queues. DELETE (the attempts and what hangs
# off them go with their task: ON DELETE CASCADE) takes under a millisecond on the few rows
# an example leaves; TRUNCATE took 50 ms, a quarter of the test's time over its examples.
RESET = (
    text("DELETE FROM core.tasks"),
    text("DELETE FROM core.task_events"),
    text("DELETE FROM core.queues"),
)
NEW_ATTEMPT = text(
    "WITH a AS (INSERT INTO core.attempts (task_id, number, worker_id)"
    " SELECT id, attempts + 1, NULL FROM core.tasks WHERE id = :id RETURNING id, task_id)"
    " UPDATE core.tasks t SET current_attempt_id = a.id FROM a WHERE t.id = a.task_id"
)
ROW = text("SELECT * FROM core.tasks WHERE id = :id")
COUNTS = text(
    "SELECT (SELECT count(*) FROM core.task_events WHERE task_id = :id),"
    " (SELECT count(*) FROM core.attempts WHERE task_id = :id)"
)
TASKS = text("SELECT * FROM core.tasks ORDER BY id")
EVENTS = text("SELECT * FROM core.task_events ORDER BY task_id, seq")
SET_RUN_AT = text("UPDATE core.tasks SET run_at = :at WHERE id = :id")
SET_RUN_AT_PAST = text("UPDATE core.tasks SET run_at = now() - interval '1 second' WHERE id = :id")


def _spec(queue: str, future: bool) -> TaskCreate:
    return TaskCreate.model_validate(
        {
            "name": f"job-{queue}",
            "queue": queue,
            "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64},
            "run_at": FUTURE if future else None,
        }
    )


@dataclass
class Model:
    """What the database should hold: each task's state, queue and whether it is due."""

    state: dict[int, TaskState] = field(default_factory=dict)
    queue: dict[int, str] = field(default_factory=dict)
    due: dict[int, bool] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)

    def add(self, task_id: int, queue: str, future: bool) -> TaskState:
        state = S.READY if future or queue in self.paused else S.WAITING
        self.state[task_id], self.queue[task_id], self.due[task_id] = state, queue, not future
        return state

    def promoter_moves(self) -> dict[int, TaskState]:
        """Where one pass of ``promote_and_park`` takes each task it moves."""
        moves: dict[int, TaskState] = {}
        for task_id, state in self.state.items():
            paused, due = self.queue[task_id] in self.paused, self.due[task_id]
            if paused and (state is S.WAITING or (state is S.FAILED and due)):
                moves[task_id] = S.READY
            elif not paused and due and state in (S.READY, S.FAILED):
                moves[task_id] = S.WAITING
        return moves


class TaskMachine(RuleBasedStateMachine):
    """Set ``runner`` and ``conn`` on a subclass (see the test below) before running: one
    connection held for the whole run, each step's work in a transaction of its own on it
    (a pool checkout and return per transaction cost more than the work)."""

    runner: asyncio.Runner
    conn: AsyncConnection
    tasks = Bundle("tasks")

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self._tx(_reset)

    # --- plumbing ---------------------------------------------------------------------

    def _tx(self, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run ``work`` in a transaction of its own: committed, or rolled back if it raises."""

        async def go() -> T:
            async with self.conn.begin():
                return await work(self.conn)

        return self.runner.run(go())

    def _snapshot(self, task_id: int) -> tuple[dict[str, Any], tuple[int, int]]:
        async def read(conn: AsyncConnection) -> tuple[dict[str, Any], tuple[int, int]]:
            row = (await conn.execute(ROW, {"id": task_id})).one()
            counts = (await conn.execute(COUNTS, {"id": task_id})).one()
            return dict(row._mapping), (counts[0], counts[1])

        return self._tx(read)

    def _refused(
        self,
        task_id: int,
        error: type[Exception],
        work: Callable[[AsyncConnection], Awaitable[object]],
    ) -> None:
        """``work`` must raise ``error`` and leave the task, its events and attempts alone."""
        before = self._snapshot(task_id)
        with pytest.raises(error):
            self._tx(work)
        assert self._snapshot(task_id) == before

    # --- rules ------------------------------------------------------------------------

    @initialize(target=tasks, submissions=st.lists(SUBMISSIONS, min_size=1, max_size=4))
    def submit_a_batch(self, submissions: list[tuple[str, bool]]) -> object:
        specs = [_spec(queue, future) for queue, future in submissions]
        rows = self._tx(lambda conn: tasks_db.submit(conn, OWNER, specs))
        for (row, created), (queue, future) in zip(rows, submissions, strict=True):
            assert created
            assert TaskState(row.state) is self.model.add(row.id, queue, future)
        return multiple(*(row.id for row, _ in rows))

    @precondition(lambda self: len(self.model.state) < MAX_TASKS)
    @rule(target=tasks, submission=SUBMISSIONS)
    def submit(self, submission: tuple[str, bool]) -> int:
        queue, future = submission
        [(row, created)] = self._tx(lambda conn: tasks_db.submit(conn, OWNER, [_spec(*submission)]))
        assert created
        assert TaskState(row.state) is self.model.add(row.id, queue, future)
        return int(row.id)

    @rule(
        task=tasks,
        op=st.sampled_from(Op),
        to=st.sampled_from(TaskState),
        reset_run_at=st.booleans(),
        backoff_over=st.booleans(),
    )
    def any_move(
        self, task: int, op: Op, to: TaskState, reset_run_at: bool, backoff_over: bool
    ) -> None:
        """Any op to any state, mostly refused (``target`` is hypothesis's own keyword)."""
        self._move(task, op, to, reset_run_at, backoff_over)

    @rule(task=tasks, data=st.data(), reset_run_at=st.booleans(), backoff_over=st.booleans())
    def legal_moves(
        self, task: int, data: st.DataObject, reset_run_at: bool, backoff_over: bool
    ) -> None:
        """A few ops in a row that the table allows from the task's state, so that moves
        land often and the task gets deep into its life. A person's cancel and retry have
        rules of their own."""
        for _ in range(data.draw(st.integers(min_value=1, max_value=4), label="moves")):
            current = self.model.state[task]
            ops = [op for op in WORKER_OPS if current in TRANSITIONS[op].sources]
            if not ops:  # final: only a person's retry (the rule below) leaves it
                return
            op = data.draw(st.sampled_from(ops), label="op")
            to = data.draw(st.sampled_from(sorted(TRANSITIONS[op].targets)), label="to")
            self._move(task, op, to, reset_run_at, backoff_over)

    @rule(
        task=tasks,
        outcome=st.sampled_from(
            [
                (Op.FAIL, S.FAILED),
                (Op.SUCCEED, S.SUCCEEDED),
                (Op.BURY, S.DEAD),
                (Op.REQUEUE, S.WAITING),
            ]
        ),
        backoff_over=st.booleans(),
    )
    def an_attempt_runs(self, task: int, outcome: tuple[Op, TaskState], backoff_over: bool) -> None:
        """A worker claims a waiting task and reports: the common path, taken often."""
        if self.model.state[task] is S.WAITING:
            self._move(task, Op.CLAIM, S.RUNNING, False, backoff_over)
            self._move(task, *outcome, False, backoff_over)

    def _move(
        self, task: int, op: Op, to: TaskState, reset_run_at: bool, backoff_over: bool
    ) -> None:
        """Apply ``op`` as core would: a claim leases an attempt first, a failure sets
        ``run_at`` to the end of its backoff (here: already over, or far off)."""
        claim = op is Op.CLAIM and to is S.RUNNING

        async def move(conn: AsyncConnection) -> TaskState:
            if claim:
                await conn.execute(NEW_ATTEMPT, {"id": task})
            left = await tasks_db.transition(
                conn,
                task,
                op,
                to,
                owner=OWNER,
                reason=f"test {op.value}",
                reset_run_at=reset_run_at,
                keep_attempt=claim,
            )
            if to is S.FAILED:
                await _set_run_at(conn, task, past=backoff_over)
            return left

        rule_ = TRANSITIONS[op]
        current = self.model.state[task]
        if current not in rule_.sources or to not in rule_.targets:
            self._refused(task, IllegalTransition, move)
            return
        assert self._tx(move) is current
        self.model.state[task] = to
        self.model.due[task] = self.model.due[task] or reset_run_at
        if to is S.FAILED:
            self.model.due[task] = backoff_over

    @rule(task=tasks, owner=OWNERS)
    def cancel(self, task: int, owner: str) -> None:
        def work(conn: AsyncConnection) -> Awaitable[None]:
            return tasks_db.cancel(conn, task, owner, "changed my mind")

        if owner != OWNER:
            self._refused(task, NotFound, work)
        elif self.model.state[task] not in TRANSITIONS[Op.CANCEL].sources:
            self._refused(task, IllegalTransition, work)
        else:
            self._tx(work)
            self.model.state[task] = S.CANCELLED

    @rule(task=tasks, owner=OWNERS)
    def retry(self, task: int, owner: str) -> None:
        def work(conn: AsyncConnection) -> Awaitable[None]:
            return tasks_db.retry(conn, task, Visibility(owner))

        if owner != OWNER:
            self._refused(task, NotFound, work)
        elif self.model.state[task] not in TRANSITIONS[Op.RETRY].sources:
            self._refused(task, IllegalTransition, work)
        else:
            self._tx(work)
            paused = self.model.queue[task] in self.model.paused
            self.model.state[task] = S.READY if paused else S.WAITING
            self.model.due[task] = True

    @rule(queue=st.sampled_from(QUEUES), paused=st.booleans(), then_promote=st.booleans())
    def pause_or_resume(self, queue: str, paused: bool, then_promote: bool) -> None:
        self._tx(lambda conn: tasks_db.set_paused(conn, queue, paused))
        assert self._tx(lambda conn: tasks_db.queue_paused(conn, queue)) is paused
        (self.model.paused.add if paused else self.model.paused.discard)(queue)
        if then_promote:
            self.promote()

    @rule(task=tasks, past=st.booleans(), then_promote=st.booleans())
    def move_run_at(self, task: int, past: bool, then_promote: bool) -> None:
        self._tx(lambda conn: _set_run_at(conn, task, past=past))
        self.model.due[task] = past
        if then_promote:
            self.promote()

    @rule()
    def promote(self) -> None:
        moves = self.model.promoter_moves()
        assert self._tx(lambda conn: tasks_db.promote_and_park(conn, 1000)) == len(moves)
        self.model.state.update(moves)

    @rule(op=st.sampled_from(Op), owner=OWNERS)
    def a_missing_task_is_not_found(self, op: Op, owner: str) -> None:
        target = min(TRANSITIONS[op].targets)
        attempt = 1 if target is S.RUNNING else None
        with pytest.raises(NotFound):
            self._tx(
                lambda conn: tasks_db.transition(
                    conn, 10**9, op, target, owner=owner, attempt_id=attempt
                )
            )

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def stored_states_match_the_model_and_histories_replay(self) -> None:
        async def read(conn: AsyncConnection) -> tuple[list[Any], list[Any]]:
            rows = list(await conn.execute(TASKS))
            return rows, list(await conn.execute(EVENTS))

        rows, events = self._tx(read)
        assert {row.id: TaskState(row.state) for row in rows} == self.model.state
        for row in rows:
            _check_history(row, [e for e in events if e.task_id == row.id])


async def _reset(conn: AsyncConnection) -> None:
    for statement in RESET:
        await conn.execute(statement)


async def _set_run_at(conn: AsyncConnection, task_id: int, *, past: bool) -> None:
    if past:
        await conn.execute(SET_RUN_AT_PAST, {"id": task_id})
    else:
        await conn.execute(SET_RUN_AT, {"id": task_id, "at": FUTURE})


def _state(value: str | None) -> TaskState | None:
    return None if value is None else TaskState(value)


def _check_history(row: Any, events: list[Any]) -> None:
    where = f"task {row.id}: {[(e.op, e.from_state, e.to_state) for e in events]}"
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), where
    assert events[-1].seq == row.version, where
    assert events[0].from_state is None and events[0].op == Op.SUBMIT, where
    previous: TaskState | None = None
    for event in events:
        pair = (_state(event.from_state), TaskState(event.to_state))
        assert pair[0] == previous, where
        assert pair in ALLOWED, where
        rule_ = TRANSITIONS[Op(event.op)]
        assert pair[0] in rule_.sources and pair[1] in rule_.targets, where
        assert event.owner == row.owner, where
        previous = pair[1]
    assert previous == TaskState(row.state), where
    assert (row.finished_at is not None) == (TaskState(row.state) in FINAL), where
    assert row.state != S.RUNNING or row.current_attempt_id is not None, where


# About 13 s alone when it passes (21 s with a TRUNCATE per example); a failure may take
# a minute or two more to shrink.
@pytest.mark.timeout(600)
def test_random_state_changes_keep_the_table_and_a_replayable_history(db_url: str) -> None:
    with asyncio.Runner() as runner:
        engine = create_async_engine(db_url, pool_size=1, max_overflow=0)
        conn = runner.run(engine.connect().start())
        bound = type("BoundTaskMachine", (TaskMachine,), {"runner": runner, "conn": conn})
        try:
            run_state_machine_as_test(
                bound,
                settings=settings(
                    max_examples=80,
                    stateful_step_count=40,
                    deadline=None,
                    # no "explain" phase: it replays a failure many times over, slowly
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow],
                ),
            )
        finally:
            runner.run(conn.close())
            runner.run(engine.dispose())
