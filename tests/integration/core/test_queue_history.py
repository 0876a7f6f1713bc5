"""``GET /v1/queues/history``: the dashboard's per-minute series, with timestamps
backdated in SQL rather than waited for."""

from __future__ import annotations

import psycopg

from tests.support import Core, spec


def test_submitted_finished_and_the_backlog_worked_back(core: Core, db: psycopg.Connection) -> None:
    with core.client() as alice:
        ids = [alice.post("/v1/tasks", json=spec(queue="hist")).json()["id"] for _ in range(3)]
        alice.post(f"/v1/tasks/{ids[2]}/cancel").raise_for_status()
        db.execute(
            "UPDATE core.tasks SET created_at = now() - interval '10 minutes 30 seconds'"
            " WHERE id = %s",
            (ids[1],),
        )
        db.execute(
            "UPDATE core.tasks SET created_at = now() - interval '30 minutes 30 seconds',"
            " finished_at = now() - interval '5 minutes 30 seconds' WHERE id = %s",
            (ids[2],),
        )
        answer = alice.get("/v1/queues/history", params={"minutes": 60})
        assert answer.status_code == 200, answer.text
        [hist] = [q for q in answer.json()["items"] if q["name"] == "hist"]
        refused = alice.get("/v1/queues/history", params={"minutes": 100_000})
    assert len(hist["submitted"]) == len(hist["finished"]) == len(hist["backlog"]) == 60
    # Oldest first: index 59 is this minute, 59 - k is k minutes ago.
    assert {59 - i for i, n in enumerate(hist["submitted"]) if n} == {0, 10, 30}
    assert {59 - i for i, n in enumerate(hist["finished"]) if n} == {5}
    backlog = {ago: hist["backlog"][59 - ago] for ago in (0, 1, 5, 6, 10, 11, 30, 31, 59)}
    assert backlog == {0: 2, 1: 1, 5: 1, 6: 2, 10: 2, 11: 1, 30: 1, 31: 0, 59: 0}
    assert refused.status_code == 422
    assert refused.json()["errors"][0]["field"] == "query.minutes"
