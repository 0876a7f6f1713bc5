from __future__ import annotations

from services.core.ops import upkeep
from services.core.settings import CoreSettings
from tests.support import Core, spec, with_engine


def test_finished_tasks_past_retention_go_with_their_events(core: Core, db, tmp_path) -> None:
    with core.client() as alice:
        old, young, live = (alice.post("/v1/tasks", json=spec()).json()["id"] for _ in range(3))
        alice.post(f"/v1/tasks/{old}/cancel")
        alice.post(f"/v1/tasks/{young}/cancel")
    db.execute(
        "INSERT INTO core.attempts (task_id, number, outcome, ended_at) VALUES (%s, 1, 'failed', now())",
        (old,),
    )
    db.execute(
        "UPDATE core.tasks SET finished_at = now() - interval '31 days' WHERE id = %s", (old,)
    )
    settings = CoreSettings(home=tmp_path, database_url=core.db_url, retention_batch=1)

    assert with_engine(core.db_url, lambda engine: upkeep.purge(engine, settings)) == 1
    remaining = {row[0] for row in db.execute("SELECT id FROM core.tasks")}
    assert remaining == {young, live}
    assert db.execute(
        "SELECT count(*) FROM core.task_events WHERE task_id = %s", (old,)
    ).fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM core.attempts").fetchone() == (0,)
