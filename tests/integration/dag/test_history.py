"""The run history grid's API against a real core and PostgreSQL: a workflow's newest
runs, oldest first, by node, each cell the node's state, try and duration as the
database holds them; bounded (``limit`` at most 100) and another owner's workflow a 404."""

from __future__ import annotations

import psycopg

from tests.fixtures.dag import DagServer, Runner, Worker, node, workflow


def test_the_grid_shows_each_run_by_node_with_durations(
    dag: DagServer, runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    nodes = [node("extract"), node("load", "extract", args=("{{ params.mode }}",))]
    runner.define(workflow("nightly", nodes, params={"mode": "ok"}))
    ids = [runner.start("nightly", params={"mode": mode})["id"] for mode in ("ok", "fail")]
    for run_id in ids:
        runner.wait_end(run_id)

    grid = runner.http.get("/v1/workflows/nightly/history")
    assert grid.status_code == 200, grid.text
    body = grid.json()
    assert body["nodes"] == ["extract", "load"]
    assert [r["id"] for r in body["runs"]] == ids  # oldest first
    assert [r["state"] for r in body["runs"]] == ["succeeded", "failed"]
    cells = [{n: c["state"] for n, c in r["nodes"].items()} for r in body["runs"]]
    assert cells == [
        {"extract": "succeeded", "load": "succeeded"},
        {"extract": "succeeded", "load": "failed"},
    ]
    held = db.execute(
        "SELECT run_id, name, EXTRACT(EPOCH FROM updated_at - started_at)::float"
        " FROM dag.nodes ORDER BY run_id, name"
    ).fetchall()
    shown = [(r["id"], n, c["duration_s"]) for r in body["runs"] for n, c in r["nodes"].items()]
    assert [(i, n, round(d, 3)) for i, n, d in held] == sorted(shown)
    assert all(d is not None and d >= 0 for _, _, d in shown)

    newest = runner.http.get("/v1/workflows/nightly/history", params={"limit": 1}).json()
    assert [r["id"] for r in newest["runs"]] == ids[1:]
    too_many = runner.http.get("/v1/workflows/nightly/history", params={"limit": 101})
    assert too_many.status_code == 422 and "limit" in too_many.text, too_many.text
    with dag.client("mallory") as stranger:
        assert stranger.get("/v1/workflows/nightly/history").status_code == 404
