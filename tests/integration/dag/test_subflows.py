"""Sub-workflows, with the DAG loop's own functions driven against a real PostgreSQL
(no core: the workflows here are sub-workflow nodes and approval gates, which never reach
it). Random parents of sub-workflow nodes under random trigger rules, each child ending
as its parameters say (its gate approved or rejected, one or two levels down), are
checked against an oracle; a parent's cancel and timeout reach its child; a leader
change between turns starts no child twice, nor ends an event node's wait twice. The tests share one database (a clone each
costs half a second), emptied of workflows and runs before each."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import networkx as nx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.common import database
from libs.common.dag_models import RUN_FINAL, WorkflowCreate
from libs.common.embedded import EmbeddedPostgres
from libs.common.leader import LeadershipLost
from services.dag import store
from services.dag.engine import Engine, Graphs
from services.dag.settings import DagSettings
from tests.integration.dag.test_property import FAILED, _runs, graphs
from tests.support import fresh_database

DB = psycopg.Connection[tuple[Any, ...]]
OWNER = "alice"
_names = itertools.count()

GATE = {
    "name": "gate",
    "params": {"verdict": "approve"},
    "nodes": [{"name": "sign", "approval": {"timeout_s": 3600, "on_timeout": "reject"}}],
}
# One level more: a child that runs the gate as its own child, passing the verdict on.
OUTER = {
    "name": "outer",
    "params": {"verdict": "approve"},
    "nodes": [
        {
            "name": "inner",
            "workflow": {"name": "gate", "params": {"verdict": "{{ params.verdict }}"}},
        }
    ],
}


@pytest.fixture(scope="module")
def db_url(pg_server: EmbeddedPostgres, template_db: str) -> Iterator[str]:
    with fresh_database(pg_server.url, template_db, "sw_") as url:
        yield url


@pytest.fixture(autouse=True)
def _empty(db: DB) -> None:
    db.execute("TRUNCATE dag.workflows, dag.runs, dag.triggers RESTART IDENTITY CASCADE")


@asynccontextmanager
async def loop_over(db_url: str, home: Path) -> AsyncIterator[Engine]:
    """The DAG loop over ``db_url``, leading; core is out of reach (nothing here needs it)."""
    conf = DagSettings(home=home, database_url=db_url, url="http://127.0.0.1:9", token="t")
    pool = database.pool(db_url, conf)
    engine = Engine(pool, conf, Graphs(64), conf.direct_url(db_url))
    engine.lease = await engine.elector.campaign()
    try:
        yield engine
    finally:
        await engine.lease.close()
        await engine.close()
        await pool.dispose()


async def define(engine: Engine, body: dict[str, Any]) -> None:
    async with engine.db.begin() as conn:
        await store.put_workflow(conn, OWNER, WorkflowCreate.model_validate(body))


async def start(engine: Engine, name: str, params: dict[str, Any], **run: Any) -> int:
    async with engine.db.begin() as conn:
        row = await store.get_workflow(conn, OWNER, name)
        dag = await engine.graphs.get(conn, row.id)
        made, _ = await store.create_run(
            conn, OWNER, row, {**dag.definition.params, **params}, None, dag.order, **run
        )
    return int(made.id)


async def decide_gates(engine: Engine) -> int:
    """Decide every waiting gate as its run's ``verdict`` says; how many."""
    async with engine.db.begin() as conn:
        waiting = (
            await conn.exec_driver_sql(
                "SELECT n.run_id, n.name, r.params->>'verdict' FROM dag.nodes n"
                " JOIN dag.runs r ON r.id = n.run_id"
                " WHERE n.state = 'waiting' AND n.decision IS NULL"
            )
        ).all()
        for run_id, name, verdict in waiting:
            await store.decide(conn, run_id, name, verdict, "carol", None)
    return len(waiting)


async def turn(engine: Engine) -> None:
    """One turn of the loop without core's feed and releases (nothing here is a task)."""
    await engine.admit()
    await engine.expire()
    await engine.gates()
    await engine.children()
    await engine.cancel_live()


async def run_until(engine: Engine, done: Callable[[], Awaitable[bool]], turns: int = 40) -> None:
    for _ in range(turns):
        await turn(engine)
        if await done():
            return
        await decide_gates(engine)
    raise AssertionError("the runs did not end")


def ended(engine: Engine, run_id: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        async with engine.db.connect() as conn:
            row = await store.get_run(conn, run_id, None)
        return str(row.state) in RUN_FINAL

    return check


def nodes(db: DB, run_id: int) -> dict[str, tuple[str, int | None]]:
    rows = db.execute(
        "SELECT name, state, child_run_id FROM dag.nodes WHERE run_id = %s", (run_id,)
    )
    return {name: (state, child) for name, state, child in rows}


def run_row(db: DB, run_id: int) -> dict[str, Any]:
    cur = db.execute(
        "SELECT state, reason, workflow, workflow_version, params, parent_run_id, parent_node,"
        " parent_try, depth FROM dag.runs WHERE id = %s",
        (run_id,),
    )
    found = cur.fetchone()
    assert found is not None
    return dict(zip([c.name for c in cur.description or ()], found, strict=True))


def expected(graph: nx.DiGraph, rule: dict[str, Any], fails: dict[str, bool]) -> dict[str, str]:
    """The oracle: a sub-workflow node whose rule is met ends as its child (rejected:
    failed); otherwise as the trigger rules say (test_property's ``_runs``)."""
    final: dict[str, str] = {}
    for name in nx.topological_sort(graph):
        verdict = _runs(rule[name], [final[up] for up in graph.predecessors(name)])
        final[name] = ("failed" if fails[name] else "succeeded") if verdict is True else verdict
    return final


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=graphs(), nested=st.lists(st.booleans(), min_size=7, max_size=7))
def test_random_parents_of_sub_workflows_end_as_the_oracle_says(
    db_url: str, db: DB, tmp_path: Path, case: Any, nested: list[bool]
) -> None:
    graph, rule, fails = case
    order = list(graph)
    name = f"parent-{next(_names)}"
    body = {
        "name": name,
        "params": {n: "approve" for n in order},
        "nodes": [
            {
                "name": n,
                "depends_on": list(graph.predecessors(n)),
                "trigger_rule": rule[n],
                "workflow": {
                    "name": "outer" if nested[i] else "gate",
                    "params": {"verdict": f"{{{{ params.{n} }}}}"},
                },
            }
            for i, n in enumerate(order)
        ],
    }
    verdicts = {n: "reject" if fails[n] else "approve" for n in order}

    async def scenario() -> int:
        async with loop_over(db_url, tmp_path) as engine:
            await define(engine, GATE)
            await define(engine, OUTER)
            await define(engine, body)
            run_id = await start(engine, name, verdicts)
            await run_until(engine, ended(engine, run_id))
            return run_id

    run_id = asyncio.run(scenario())
    final = expected(graph, rule, fails)
    stored = nodes(db, run_id)
    assert {n: s for n, (s, _) in stored.items()} == final
    leaves = [n for n in order if graph.out_degree(n) == 0]
    outcome = "failed" if any(final[n] in FAILED for n in leaves) else "succeeded"
    assert run_row(db, run_id)["state"] == outcome
    for i, n in enumerate(order):
        child = stored[n][1]
        ran = final[n] in ("succeeded", "failed")
        assert (child is not None) == ran, n
        if child is not None:
            row = run_row(db, child)
            assert (row["parent_run_id"], row["parent_node"], row["parent_try"]) == (run_id, n, 1)
            assert row["workflow"] == ("outer" if nested[i] else "gate") and row["depth"] == 1
            assert row["params"] == {"verdict": verdicts[n]}
            assert row["state"] == final[n]
    children = db.execute(
        "SELECT count(*) FROM dag.runs WHERE parent_run_id = %s", (run_id,)
    ).fetchone()
    assert children == (sum(1 for n in order if stored[n][1] is not None),)


def test_the_child_runs_the_newest_version_when_the_parent_started_or_the_pinned_one(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    async def scenario() -> tuple[int, int]:
        async with loop_over(db_url, tmp_path) as engine:
            await define(engine, GATE)  # version 1
            newest = {**GATE, "description": "version 2"}
            await define(engine, newest)
            await define(
                engine,
                {
                    "name": "both",
                    "nodes": [
                        {"name": "latest", "workflow": {"name": "gate"}},
                        {"name": "pinned", "workflow": {"name": "gate", "version": 1}},
                    ],
                },
            )
            run_id = await start(engine, "both", {})
            await turn(engine)
            await define(engine, {**GATE, "description": "version 3, after the start"})
            await run_until(engine, ended(engine, run_id))
            return run_id, 0

    run_id, _ = asyncio.run(scenario())
    stored = nodes(db, run_id)
    versions = {n: run_row(db, child)["workflow_version"] for n, (_, child) in stored.items()}
    assert versions == {"latest": 2, "pinned": 1}
    assert run_row(db, run_id)["state"] == "succeeded"


def test_cancelling_the_parent_cancels_its_child(db_url: str, db: DB, tmp_path: Path) -> None:
    async def scenario() -> int:
        async with loop_over(db_url, tmp_path) as engine:
            await define(engine, GATE)
            await define(engine, OUTER)
            await define(
                engine, {"name": "p", "nodes": [{"name": "s", "workflow": {"name": "outer"}}]}
            )
            run_id = await start(engine, "p", {})
            for _ in range(4):  # the child, then its child, start; the gate waits
                await turn(engine)
            async with engine.db.begin() as conn:
                await store.cancel_run(conn, run_id, None)
            for _ in range(3):  # one level of children a turn
                await turn(engine)
            return run_id

    run_id = asyncio.run(scenario())
    (state, child) = nodes(db, run_id)["s"]
    assert child is not None and state == "cancelled"
    outer = run_row(db, child)
    assert outer["state"] == "cancelled"
    assert outer["reason"] == f"its parent run {run_id} ended before it (node s)"
    grandchild = nodes(db, child)["inner"][1]
    assert grandchild is not None
    assert (run_row(db, grandchild)["state"], run_row(db, grandchild)["depth"]) == ("cancelled", 2)
    assert nodes(db, grandchild) == {"sign": ("cancelled", None)}


def test_the_parents_timeout_covers_its_child(db_url: str, db: DB, tmp_path: Path) -> None:
    async def scenario() -> int:
        async with loop_over(db_url, tmp_path) as engine:
            await define(engine, GATE)
            await define(
                engine, {"name": "p", "nodes": [{"name": "s", "workflow": {"name": "gate"}}]}
            )
            run_id = await start(engine, "p", {}, timeout_s=3600)
            await turn(engine)
            await turn(engine)
            # Past its deadline, as if an hour went by.
            async with engine.db.begin() as conn:
                await conn.exec_driver_sql(
                    f"UPDATE dag.runs SET deadline = now() - interval '1 s' WHERE id = {run_id}"
                )
            await turn(engine)
            await turn(engine)
            return run_id

    run_id = asyncio.run(scenario())
    assert run_row(db, run_id)["state"] == "failed"
    (state, child) = nodes(db, run_id)["s"]
    assert state == "cancelled" and child is not None
    assert run_row(db, child)["state"] == "cancelled"
    assert nodes(db, child) == {"sign": ("cancelled", None)}


def test_a_leader_change_starts_no_child_twice(db_url: str, db: DB, tmp_path: Path) -> None:
    async def scenario() -> int:
        async with loop_over(db_url, tmp_path) as first:
            await define(first, GATE)
            await define(
                first, {"name": "p", "nodes": [{"name": "s", "workflow": {"name": "gate"}}]}
            )
            run_id = await start(first, "p", {})
            await first.admit()  # the child starts in the transaction that readies the node
            stale = first.lease
            await stale.close()  # the leader dies; another takes over
            async with loop_over(db_url, tmp_path) as second:
                await run_until(second, ended(second, run_id))
                first.lease = stale  # the old leader comes back: fenced, it writes nothing
                with pytest.raises(LeadershipLost):
                    async with first._write():
                        pass
            first.lease = await first.elector.campaign()
            return run_id

    run_id = asyncio.run(scenario())
    assert run_row(db, run_id)["state"] == "succeeded"
    assert db.execute(
        "SELECT count(*) FROM dag.runs WHERE parent_run_id = %s", (run_id,)
    ).fetchone() == (1,)


def test_a_child_starts_at_most_once_per_parent_node_try(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    """The unique (parent run, node, try) index: a second start of the same try answers
    the first child (as a replayed transaction after a crash would)."""

    async def scenario() -> tuple[int, int]:
        async with loop_over(db_url, tmp_path) as engine:
            await define(engine, GATE)
            await define(
                engine, {"name": "p", "nodes": [{"name": "s", "workflow": {"name": "gate"}}]}
            )
            run_id = await start(engine, "p", {})
            await engine.admit()
            async with engine.db.begin() as conn:
                parent = await store.get_run(conn, run_id, None)
                gate = await store.get_workflow(conn, OWNER, "gate")
                again = await store.start_child(
                    conn, parent, "s", 1, gate, {}, ["sign"], None, None, None
                )
            return run_id, again

    run_id, again = asyncio.run(scenario())
    assert nodes(db, run_id)["s"] == ("running", again)
    assert db.execute(
        "SELECT count(*) FROM dag.runs WHERE parent_run_id = %s", (run_id,)
    ).fetchone() == (1,)


def test_a_child_that_cannot_start_fails_its_node_and_the_rules_go_on(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    strict = {
        "name": "strict",
        "nodes": [
            {
                "name": "t",
                "task": {
                    "artifact": {"uri": "file:///bin/true", "sha256": "ab" * 32},
                    "args": ["{{ params.need }}"],
                },
            }
        ],
    }
    parent = {
        "name": "p",
        "nodes": [
            {"name": "s", "workflow": {"name": "strict", "params": {"other": 1}}},
            {"name": "after", "depends_on": ["s"], "workflow": {"name": "gate"}},
            {
                "name": "cleanup",
                "depends_on": ["s"],
                "trigger_rule": "all_done",
                "workflow": {"name": "gate"},
            },
        ],
    }

    async def scenario() -> int:
        async with loop_over(db_url, tmp_path) as engine:
            for body in (strict, GATE, parent):
                await define(engine, body)
            run_id = await start(engine, "p", {})
            await run_until(engine, ended(engine, run_id))
            return run_id

    run_id = asyncio.run(scenario())
    rows = db.execute(
        "SELECT name, state, error, child_run_id FROM dag.nodes WHERE run_id = %s ORDER BY name",
        (run_id,),
    ).fetchall()
    assert [(n, s) for n, s, _, _ in rows] == [
        ("after", "upstream_failed"), ("cleanup", "succeeded"), ("s", "failed"),
    ]  # fmt: skip
    error, child = rows[2][2], rows[2][3]
    assert child is None
    assert error == "the sub-workflow's body.params.other: not a parameter of this workflow"
    assert run_row(db, run_id)["state"] == "failed"


def test_an_event_delivered_to_a_child_run_ends_its_wait_and_the_parent_keeps_its_data(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    """Sub-workflows and event nodes together: the child waits for its event, which is
    delivered to the child run; its data are the event node's outputs, then the
    sub-workflow node's, and the parent's own event node times out to its default."""
    child = {
        "name": "waiter",
        "nodes": [
            {
                "name": "paid",
                "event": {"name": "payment", "timeout_s": 3600},
                "outputs": {"amount": {}},
            }
        ],
    }
    parent = {
        "name": "p",
        "nodes": [
            {"name": "s", "workflow": {"name": "waiter"}, "outputs": {"amount": {}}},
            {
                "name": "late",
                "depends_on": ["s"],
                "event": {"name": "never", "timeout_s": 3600, "on_timeout": "succeed"},
            },
        ],
    }

    async def scenario() -> tuple[int, int]:
        async with loop_over(db_url, tmp_path) as engine:
            for body in (child, parent):
                await define(engine, body)
            run_id = await start(engine, "p", {})
            await turn(engine)
            await turn(engine)  # the child admitted: its event node waits
            child_id = nodes(db, run_id)["s"][1]
            assert child_id is not None
            assert nodes(db, child_id) == {"paid": ("waiting", None)}
            async with engine.db.begin() as conn:
                await store.deliver_event(conn, child_id, "payment", {"amount": 120}, "carol")
            for _ in range(3):  # the child's node ends, then the child, then the parent's node
                await turn(engine)
            assert nodes(db, run_id)["late"][0] == "waiting"
            async with engine.db.begin() as conn:  # as if the hour went by
                await conn.exec_driver_sql(
                    f"UPDATE dag.nodes SET wait_until = now() WHERE run_id = {run_id}"
                )
            await run_until(engine, ended(engine, run_id), turns=3)
            return run_id, child_id

    run_id, child_id = asyncio.run(scenario())
    kept = db.execute(
        "SELECT run_id, name, state, outputs FROM dag.nodes WHERE run_id IN (%s, %s)"
        " ORDER BY run_id, name",
        (run_id, child_id),
    ).fetchall()
    assert kept == [
        (run_id, "late", "succeeded", None),
        (run_id, "s", "succeeded", {"amount": 120}),
        (child_id, "paid", "succeeded", {"amount": 120}),
    ]
    assert (run_row(db, run_id)["state"], run_row(db, child_id)["state"]) == (
        "succeeded",
        "succeeded",
    )


def test_an_event_delivered_across_a_leader_change_ends_its_wait_once(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    """An event node waits; its event is delivered; the leader dies before it ends the
    wait. The next leader ends it (the data become its outputs) and the run goes on; the
    old leader, back, is fenced: the node ended once, the event is kept once."""
    body = {
        "name": "pay",
        "params": {"verdict": "approve"},
        "nodes": [
            {"name": "paid", "event": {"name": "payment", "timeout_s": 3600}, "outputs": {"n": {}}},
            {
                "name": "sign",
                "depends_on": ["paid"],
                "approval": {"timeout_s": 3600, "on_timeout": "reject"},
            },
        ],
    }

    async def scenario() -> int:
        async with loop_over(db_url, tmp_path) as first:
            await define(first, body)
            run_id = await start(first, "pay", {})
            await turn(first)
            assert nodes(db, run_id)["paid"][0] == "waiting"
            async with first.db.begin() as conn:
                await store.deliver_event(conn, run_id, "payment", {"n": 7}, "carol")
            stale = first.lease
            await stale.close()  # the leader dies before its next turn ends the wait
            async with loop_over(db_url, tmp_path) as second:
                await run_until(second, ended(second, run_id))
                first.lease = stale  # the old leader comes back: fenced, it writes nothing
                await first.gates()  # nothing due any more: nothing to write
                with pytest.raises(LeadershipLost):
                    async with first._write():
                        pass
            first.lease = await first.elector.campaign()
            return run_id

    run_id = asyncio.run(scenario())
    assert run_row(db, run_id)["state"] == "succeeded"
    rows = db.execute(
        "SELECT name, state, outputs, try_number FROM dag.nodes WHERE run_id = %s ORDER BY name",
        (run_id,),
    ).fetchall()
    assert rows == [("paid", "succeeded", {"n": 7}, 1), ("sign", "succeeded", None, 1)]
    assert db.execute(
        "SELECT count(*) FROM dag.run_events WHERE run_id = %s", (run_id,)
    ).fetchone() == (1,)


def test_a_release_recorded_under_a_superseded_epoch_writes_nothing(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    """The release's record sends its COMMIT in the round trip of the fence and its
    UPDATE (``store.record_released``): under an epoch another leader superseded, the
    UPDATE writes nothing (the node stays ready for the new leader to release) and the
    fence's answer stops the old one; under the current epoch it records the task."""
    one = {
        "name": "one",
        "nodes": [
            {"name": "t", "task": {"artifact": {"uri": "file:///bin/true", "sha256": "ab" * 32}}}
        ],
    }

    async def scenario() -> tuple[int, set[int], set[int]]:
        async with loop_over(db_url, tmp_path) as first:
            await define(first, one)
            run_id = await start(first, "one", {})
            await first.admit()
            assert nodes(db, run_id) == {"t": ("ready", None)}
            stale = first.lease
            assert stale is not None
            await stale.close()  # the leader dies; another takes over
            async with loop_over(db_url, tmp_path) as second:
                assert second.lease is not None and second.lease.epoch == stale.epoch + 1
                async with first.db.begin() as conn:
                    fence, old = await store.record_released(
                        conn, [(run_id, "t", 1, 7001)], stale.fencing(durable=False), stale.epoch
                    )
                with pytest.raises(LeadershipLost):
                    stale.fenced(fence[0].epoch)
                assert nodes(db, run_id) == {"t": ("ready", None)}
                lease = second.lease
                async with second.db.begin() as conn:
                    fence, new = await store.record_released(
                        conn, [(run_id, "t", 1, 7002)], lease.fencing(durable=False), lease.epoch
                    )
                lease.fenced(fence[0].epoch)
            first.lease = await first.elector.campaign()
            return run_id, old, new

    run_id, old, new = asyncio.run(scenario())
    assert old == set() and new == {7002}
    assert db.execute(
        "SELECT state, task_id FROM dag.nodes WHERE run_id = %s", (run_id,)
    ).fetchone() == ("released", 7002)
