"""The DAG service tells core of runs that end failed, for the owner's notifications."""

from __future__ import annotations

from typing import Any

from tests.fixtures.dag import Runner, Worker, node, workflow
from tests.support import Core, wait_for
from tests.webhooks import Receiver, subscribe


def _delivered(db: Any, count: int) -> bool:
    row = db.execute(
        "SELECT count(*), count(*) FILTER (WHERE state = 'delivered') FROM core.notifications"
    ).fetchone()
    return bool(row == (count, count))


def test_a_failed_run_and_its_failed_retry_each_reach_the_webhook(
    core: Core, runner: Runner, worker: Worker, db: Any
) -> None:
    hook = Receiver()
    try:
        with core.client() as alice:
            made = subscribe(alice, hook.url, events=["run.failed"])
        run = runner.run(workflow("breaks", [node("a"), node("b", "a", args=("fail",))]))
        assert run["state"] == "failed"
        wait_for(lambda: _delivered(db, 1), timeout=20)
        assert runner.http.post(f"/v1/runs/{run['id']}/retry").status_code == 200
        assert runner.wait_end(run["id"])["state"] == "failed"
        wait_for(lambda: _delivered(db, 2), timeout=20)
    finally:
        hook.close()
    got = hook.all()
    assert len(got) == 2
    assert all(r.signed_by(made["secret"]) for r in got)
    assert [r.doc["event"] for r in got] == ["run.failed", "run.failed"]
    assert [r.doc["data"]["subject"] for r in got] == [
        {"run_id": str(run["id"]), "workflow": "breaks"}
    ] * 2
    assert got[0].doc["owner"] == "alice"
