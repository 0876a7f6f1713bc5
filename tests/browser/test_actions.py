"""The dashboard's live pages and actions in a real browser against the running system
(docs/dashboard.md): the queue and run pages change without a reload, the dead set is
retried in bulk after a confirmation that shows the dry run's count (a user's own tasks, an
admin's of every owner), tasks are cancelled in bulk by filter, schedules are paused,
resumed and triggered, runs cancelled and retried, and a run shows its nodes' outputs and
mapped instances, and a workflow's run history grid shows each node's state and duration by run.
Each test checks what the services hold afterwards, not only the page."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Page, expect

from libs.common.settings import libpq_url
from tests.browser.conftest import System, log_in, screenshot
from tests.browser.test_dashboard import client
from tests.fixtures.dag import node, workflow
from tests.support import register_worker, spec, wait_for

FAR = "2999-01-01T00:00:00Z"


@pytest.fixture
def db(system: System) -> Iterator[psycopg.Connection]:
    with psycopg.connect(libpq_url(system.core.db_url), autocommit=True) as conn:
        yield conn


class HandWorker:
    """A worker on a queue of its own, claiming and reporting only when the test says."""

    def __init__(self, system: System, name: str, queue: str) -> None:
        self.http = client(system, system.core.url, name, "worker")
        offer = {"hostname": name, "queues": [queue], "cpu": 4, "memory_mb": 4096}
        self.id = register_worker(self.http, offer)

    def __enter__(self) -> HandWorker:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()

    def claim(self, count: int) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []

        def claimed() -> bool:
            room = {"cpu": 4, "memory_mb": 4096, "max": count - len(found), "wait": 2}
            path = f"/v1/workers/{self.id}/claim"
            found.extend(self.http.post(path, json=room).raise_for_status().json()["attempts"])
            return len(found) >= count

        wait_for(claimed, timeout=30)
        return found

    def report(self, attempt: dict[str, Any], outcome: str, **extra: Any) -> None:
        body = {"outcome": outcome, "exit_code": 0 if outcome == "succeeded" else 1, **extra}
        path = f"/v1/workers/{self.id}/attempts/{attempt['attempt_id']}/report"
        self.http.post(path, json=body).raise_for_status()


def _state(db: psycopg.Connection, task_id: int) -> str:
    row = db.execute("SELECT state FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return str(row[0])


def _bury(system: System, hands: HandWorker, owner: str, queue: str, n: int) -> list[int]:
    """``n`` tasks of ``owner`` in ``queue``, dead: their one attempt failed, not retryable."""
    with client(system, system.core.url, owner) as http:
        ids = [
            http.post("/v1/tasks", json=spec(name=f"nightly-{i}", queue=queue)).json()["id"]
            for i in range(n)
        ]
    for attempt in hands.claim(n):
        hands.report(attempt, "failed", retryable=False)
    return ids


def test_the_queue_page_updates_without_a_reload(page: Page, system: System) -> None:
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/queues")
    expect(page.locator("table").first).to_be_visible()
    page.evaluate("window.notReloaded = true")
    with client(system, system.core.url, "alice") as alice:
        later = [
            alice.post("/v1/tasks", json=spec(queue="live-q", run_at=FAR)).json() for _ in "ab"
        ]
        row = page.locator("tr[data-queue='live-q']")
        expect(row.locator("td").nth(1)).to_have_text("2")
        alice.post(f"/v1/tasks/{later[0]['id']}/cancel").raise_for_status()
        expect(row.locator("td").nth(1)).to_have_text("1")
        depth = alice.get("/v1/queues").json()["items"]
        assert next(q for q in depth if q["name"] == "live-q")["depth"]["ready"] == 1
    assert page.evaluate("window.notReloaded") is True


def test_the_run_page_follows_a_run_without_a_reload(page: Page, system: System) -> None:
    queue = "live-run"
    body = workflow(
        "followed",
        [node("extract", task={"queue": queue}), node("load", "extract", task={"queue": queue})],
    )
    with (
        client(system, system.dag.url, "alice") as alice,
        HandWorker(system, "run-hands", queue) as hands,
    ):
        assert alice.post("/v1/workflows", json=body).status_code in (200, 201)
        run = alice.post("/v1/workflows/followed/runs", json={}).json()
        log_in(page, system, "alice")
        page.goto(f"{system.core.url}/ui#/runs/{run['id']}")
        page.evaluate("window.notReloaded = true")
        extract = page.locator("#run-graph g.node[data-node='extract']")
        load = page.locator("#run-graph g.node[data-node='load']")
        [first] = hands.claim(1)
        expect(extract).to_have_attribute("data-state", "running")
        expect(load).to_have_attribute("data-state", "pending")
        hands.report(first, "succeeded")
        expect(extract).to_have_attribute("data-state", "succeeded")
        [second] = hands.claim(1)
        expect(load).to_have_attribute("data-state", "running")
        hands.report(second, "succeeded")
        expect(page.locator("#run-state [data-state='succeeded']")).to_be_visible()
        assert alice.get(f"/v1/runs/{run['id']}").json()["state"] == "succeeded"
    assert page.evaluate("window.notReloaded") is True


def test_the_dead_set_is_retried_after_a_confirmation_with_its_count(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    queue = "dead-set"
    with HandWorker(system, "dead-hands", queue) as hands:
        alices = _bury(system, hands, "alice", queue, 3)
        [bobs] = _bury(system, hands, "bob", queue, 1)
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/dead?queue={queue}")
    expect(page.locator("tr[data-task-id]")).to_have_count(3)  # alice's, not bob's
    page.click("#bulk-retry")
    expect(page.locator("#confirm-text")).to_have_text("Retry 3 tasks of yours?")
    page.click("#confirm-no")  # no: nothing moves
    expect(page.locator("#confirm")).to_be_hidden()
    assert {_state(db, t) for t in alices} == {"dead"}
    page.click("#bulk-retry")
    expect(page.locator("#confirm")).to_have_attribute("data-count", "3")
    screenshot(page, "dead-set")
    page.click("#confirm-yes")
    expect(page.locator("#bulk-message")).to_have_text("retried 3 tasks")
    assert {_state(db, t) for t in alices} == {"waiting"}
    assert _state(db, bobs) == "dead"
    expect(page.locator("tr[data-task-id]")).to_have_count(0)
    reasons = db.execute(
        "SELECT DISTINCT reason FROM core.task_events WHERE op = 'retry' AND task_id = ANY(%s)",
        (alices,),
    ).fetchall()
    assert reasons == [("retried in bulk by alice",)]

    log_in(page, system, "root", "admin")  # an admin's reach every owner
    page.goto(f"{system.core.url}/ui#/dead?queue={queue}")
    expect(page.locator(f"tr[data-task-id='{bobs}']")).to_be_visible()
    page.click("#bulk-retry")
    expect(page.locator("#confirm-text")).to_have_text("Retry 1 task of every owner?")
    page.click("#confirm-yes")
    expect(page.locator("#bulk-message")).to_have_text("retried 1 task")
    assert _state(db, bobs) == "waiting"
    audit = db.execute(
        "SELECT count(*) FROM core.audit WHERE action = 'task.bulk.retry' AND actor = 'root'"
    ).fetchone()
    assert audit == (1,)


def test_tasks_are_cancelled_in_bulk_by_label(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    with client(system, system.core.url, "alice") as alice:
        batch = [
            alice.post("/v1/tasks", json=spec(run_at=FAR, labels={"batch": "x"})).json()["id"]
            for _ in range(4)
        ]
        other = alice.post("/v1/tasks", json=spec(run_at=FAR, labels={"batch": "y"})).json()
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/tasks?label=batch%3Dx")
    expect(page.locator("tr[data-task-id]")).to_have_count(4)
    page.click("#bulk-cancel")
    expect(page.locator("#confirm-text")).to_have_text("Cancel 4 tasks of yours?")
    page.click("#confirm-yes")
    expect(page.locator("#bulk-message")).to_have_text("cancelled 4 tasks")
    assert {_state(db, t) for t in batch} == {"cancelled"}
    assert _state(db, other["id"]) == "ready"
    page.click("#bulk-cancel")
    expect(page.locator("#confirm-text")).to_have_text("No task of yours matches.")
    expect(page.locator("#confirm-yes")).to_have_count(0)


def test_a_schedule_is_paused_resumed_and_triggered(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    body = {
        "name": "yearly-report",
        "expression": "0 0 1 1 *",
        "target": {"kind": "task", "task": spec(name="yearly", queue="yearly")},
    }
    with client(system, system.cron.url, "alice") as alice:
        created = alice.post("/v1/schedules", json=body)
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        log_in(page, system, "alice")
        page.goto(f"{system.core.url}/ui#/schedules")
        row = page.locator(f"tr[data-schedule-id='{sid}']")
        row.locator(f"#pause-{sid}").click()
        expect(row).to_have_attribute("data-paused", "true")
        expect(page.locator("#schedule-message")).to_have_text("schedule yearly-report paused")
        assert alice.get(f"/v1/schedules/{sid}").json()["paused"] is True
        row.locator(f"#resume-{sid}").click()
        expect(row).to_have_attribute("data-paused", "false")
        assert alice.get(f"/v1/schedules/{sid}").json()["paused"] is False
        row.locator(f"#trigger-{sid}").click()
        expect(page.locator("#schedule-message")).to_contain_text("fired: submitted, task ")
        [fire] = alice.get(f"/v1/schedules/{sid}/fires").json()["items"]
        assert fire["manual"] is True and fire["task_id"] is not None
    task = db.execute(
        "SELECT owner, name FROM core.tasks WHERE id = %s", (fire["task_id"],)
    ).fetchone()
    assert task == ("alice", "yearly")


def _node_of(run: dict, name: str) -> dict:
    return next(n for n in run["nodes"] if n["name"] == name)


def test_a_run_is_cancelled_from_the_runs_page_and_retried_from_its_page(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    body = workflow("held", [node("wait", args=("hold",))])
    with client(system, system.dag.url, "alice") as alice:
        assert alice.post("/v1/workflows", json=body).status_code in (200, 201)
        run = alice.post("/v1/workflows/held/runs", json={}).json()
        rid = run["id"]

        def running() -> dict | None:
            found = alice.get(f"/v1/runs/{rid}").json()
            return found if _node_of(found, "wait")["state"] == "running" else None

        first_task = _node_of(wait_for(running, 30), "wait")["task_id"]
        log_in(page, system, "alice")
        page.goto(f"{system.core.url}/ui#/runs")
        page.locator(f"#cancel-run-{rid}").click()
        expect(page.locator(f"tr[data-run-id='{rid}'] [data-state='cancelled']")).to_be_visible()
        assert alice.get(f"/v1/runs/{rid}").json()["state"] == "cancelled"
        wait_for(lambda: _state(db, first_task) == "cancelled")
        page.goto(f"{system.core.url}/ui#/runs/{rid}")
        page.locator(f"#retry-run-{rid}").click()
        expect(page.locator("#run-message")).to_contain_text(f"run {rid} retried")
        retried = _node_of(wait_for(running, 30), "wait")
        assert retried["try_number"] == 2 and retried["task_id"] != first_task
        expect(page.locator("#run-graph g.node[data-node='wait']")).to_have_attribute(
            "data-state", "running"
        )
        page.locator(f"#cancel-run-{rid}").click()  # and from the run's own page
        expect(page.locator("#run-state [data-state='cancelled']")).to_be_visible()
        wait_for(lambda: _state(db, retried["task_id"]) == "cancelled")


def test_a_run_shows_outputs_mapped_instances_a_skipped_branch_and_retries_the_failed_ones(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    body = workflow(
        "mapped-view",
        [
            node("extract", args=("out", '{"rows": 12}'), outputs={"rows": {}}),
            node(
                "each",
                "extract",
                args=("{{ map.item }}", "2", "{{ node.try }}"),
                map={"over": "{{ params.items }}"},
            ),
            node("big-only", "extract", when="nodes.extract.outputs.rows > 100"),
        ],
    )
    params = {"items": ["ok", "fail-below", "ok"]}
    with client(system, system.dag.url, "alice") as alice:
        assert alice.post("/v1/workflows", json=body).status_code in (200, 201)
        rid = alice.post("/v1/workflows/mapped-view/runs", json={"params": params}).json()["id"]
        wait_for(lambda: alice.get(f"/v1/runs/{rid}").json()["state"] == "failed", 30)
        log_in(page, system, "alice")
        page.goto(f"{system.core.url}/ui#/runs/{rid}")
        outputs = page.locator("tr[data-node-row='extract'] td.node-outputs")
        expect(outputs).to_contain_text("rows")
        expect(outputs).to_contain_text("12")
        instances = page.locator("tr[data-map-of='each']")
        expect(instances).to_have_count(3)
        expect(page.locator("tr[data-node-row='each[1]'] [data-state='failed']")).to_be_visible()
        expect(page.locator("tr[data-node-row='each[1]']")).to_contain_text("fail-below")
        branch = page.locator("tr[data-node-row='big-only']")
        expect(branch.locator("[data-state='skipped']")).to_be_visible()
        expect(branch.locator("td.node-reason")).to_have_text(
            "when is false: nodes.extract.outputs.rows > 100"
        )
        graph_node = page.locator("#run-graph g.node[data-node='each']")
        expect(graph_node).to_have_attribute("data-instances", "3")
        expect(graph_node.locator("text")).to_have_text("each 2/3")
        screenshot(page, "run-mapped")
        page.locator(f"#retry-instances-{rid}").click()
        expect(page.locator("#run-state [data-state='succeeded']")).to_be_visible()
        expect(graph_node.locator("text")).to_have_text("each 3/3")
        done = alice.get(f"/v1/runs/{rid}").json()
    tries = {n["name"]: n["try_number"] for n in done["nodes"]}
    assert tries == {
        "extract": 1, "each": 2, "each[0]": 1, "each[1]": 2, "each[2]": 1, "big-only": 1
    }  # fmt: skip
    assert _node_of(done, "big-only")["state"] == "skipped"  # the retry kept the branch's skip
    assert _node_of(done, "extract")["outputs"] == {"rows": 12}
    keys = db.execute(
        "SELECT count(*) FROM core.tasks WHERE labels->>'cairn.dag/run' = %s", (str(rid),)
    ).fetchone()
    assert keys == (5,)  # extract, three instances, one instance again; big-only none


def test_a_waiting_approval_gate_is_approved_from_the_run_page(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    gate = {"name": "sign-off", "approval": {"timeout_s": 3600, "on_timeout": "reject"}}
    with client(system, system.dag.url, "alice") as alice:
        assert alice.post("/v1/workflows", json=workflow("gated", [gate])).status_code in (200, 201)
        rid = alice.post("/v1/workflows/gated/runs", json={}).json()["id"]
        wait_for(lambda: _node_of(alice.get(f"/v1/runs/{rid}").json(), "sign-off")["state"]
                 == "waiting", 30)  # fmt: skip
        log_in(page, system, "alice")
        page.goto(f"{system.core.url}/ui#/runs/{rid}")
        row = page.locator("tr[data-node-row='sign-off']")
        expect(row.locator("[data-state='waiting']")).to_be_visible()
        page.locator("#gate-comment-sign-off").fill("from the page")
        page.locator("#approve-sign-off").click()
        expect(page.locator("#run-message")).to_contain_text("sign-off approved")
        expect(page.locator("#run-state [data-state='succeeded']")).to_be_visible()
        expect(row.locator("td.node-gate")).to_have_text("approved by alice: from the page")
    found = db.execute(
        "SELECT state, decision, decided_by, comment FROM dag.nodes"
        " WHERE run_id = %s AND name = 'sign-off'",
        (rid,),
    ).fetchone()
    assert found == ("succeeded", "approve", "alice", "from the page")


def test_a_sub_workflow_node_links_its_child_run_and_the_child_its_parent(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    with client(system, system.dag.url, "alice") as alice:
        child = workflow("sub-child", [node("work")])
        parent = workflow("sub-parent", [{"name": "sub", "workflow": {"name": "sub-child"}}])
        for body in (child, parent):
            assert alice.post("/v1/workflows", json=body).status_code in (200, 201)
        rid = alice.post("/v1/workflows/sub-parent/runs", json={}).json()["id"]
        done = wait_for(lambda: (r := alice.get(f"/v1/runs/{rid}").json())["state"] == "succeeded"
                        and r, 30)  # fmt: skip
    child_id = _node_of(done, "sub")["child_run_id"]
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/runs/{rid}")
    link = page.locator("tr[data-node-row='sub'] a.child-run")
    expect(link).to_have_text(f"run {child_id}")
    link.click()
    expect(page.locator("#run-parent")).to_contain_text(f"sub-workflow of run {rid} (node sub)")
    expect(page.locator("tr[data-node-row='work'] [data-state='succeeded']")).to_be_visible()
    found = db.execute(
        "SELECT parent_run_id, parent_node, state FROM dag.runs WHERE id = %s", (child_id,)
    ).fetchone()
    assert found == (rid, "sub", "succeeded")


def test_the_run_history_grid_shows_each_node_by_run_with_its_duration(
    page: Page, system: System, db: psycopg.Connection
) -> None:
    nodes = [node("extract"), node("load", "extract", args=("{{ params.mode }}",))]
    with client(system, system.dag.url, "alice") as alice:
        made = alice.post("/v1/workflows", json=workflow("grid", nodes, params={"mode": "ok"}))
        assert made.status_code in (200, 201), made.text
        ids = [
            alice.post("/v1/workflows/grid/runs", json={"params": {"mode": mode}}).json()["id"]
            for mode in ("ok", "fail")
        ]
        for rid in ids:
            wait_for(lambda r=rid: alice.get(f"/v1/runs/{r}").json()["state"] in ("succeeded", "failed"), 30)  # fmt: skip
        newest = alice.get("/v1/workflows/grid/history", params={"limit": 1}).json()
        assert [r["id"] for r in newest["runs"]] == ids[1:]  # the newest N, oldest first
        too_many = alice.get("/v1/workflows/grid/history", params={"limit": 101})
        assert too_many.status_code == 422 and "limit" in too_many.text, too_many.text
    with client(system, system.dag.url, "mallory") as stranger:
        assert stranger.get("/v1/workflows/grid/history").status_code == 404
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/runs/{ids[1]}")
    page.locator("#run-state a", has_text="grid").click()  # the workflow's history
    grid = page.locator("#history table.history")
    expect(grid.locator("th.run-col")).to_have_count(2)
    load = grid.locator("tr[data-node-row='load'] td.cell")
    expect(load.nth(0)).to_have_attribute("data-state", "succeeded")
    expect(load.nth(1)).to_have_attribute("data-state", "failed")
    took = re.compile(rf"^load in run {ids[1]}: failed, \S+ \((\d+\.\d{{3}}) s\)$")
    expect(load.nth(1)).to_have_attribute("title", took)
    screenshot(page, "run-history")
    held = db.execute(
        "SELECT run_id, name, state, EXTRACT(EPOCH FROM updated_at - started_at)::float"
        " FROM dag.nodes WHERE run_id = ANY(%s) ORDER BY name, run_id",
        (ids,),
    ).fetchall()
    cells = page.locator("#history td.cell")
    shown = [
        (
            int(c.get_attribute("data-run-id") or 0),
            c.get_attribute("data-state"),
            c.get_attribute("title"),
        )
        for c in cells.all()
    ]
    assert [(r, s) for r, _, s, _ in held] == [(r, s) for r, s, _ in shown]
    for (_, _, _, seconds), (_, _, title) in zip(held, shown, strict=True):
        found = re.search(r"\((\d+\.\d{3}) s\)", title or "")
        assert found and abs(float(found.group(1)) - seconds) < 0.002, (seconds, title)
