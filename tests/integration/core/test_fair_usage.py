"""Fair share by usage, with a real worker agent (docs/sharing.md, "Fair share by usage"):
an owner who reserved a lot lately is served after one who reserved little, and as the
usage decays (a one-second half-life here) the two interleave again. On the way, the
month's sums are asserted against what the agent measured of the attempts."""

from __future__ import annotations

import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.integration.core.test_bad_input import problem
from tests.support import Core, shell_spec, spawn_worker, spec, stop_process, wait_for

DB = psycopg.Connection[tuple[Any, ...]]
HALF_LIFE_S = 1.0
# A fine step, so the burn pushes hog about 2,000 steps back: under a loaded machine
# several seconds may pass between the burn's end and the next submissions, each halving
# it, and it must still be more than lamb's three steps then.
UNIT_CPU_S = 0.001
# Tasks that reserve next to nothing (their own use barely moves the scales).
TASK = {"resources": {"cpu": 0.001, "memory_mb": 64}}
# What the heavy owner ran first: half a second of CPU, a second held of 2 cores.
BURN = "end=$(($(date +%s%N) + 500000000)); while [ $(date +%s%N) -lt $end ]; do :; done; sleep 0.5"


pytestmark = pytest.mark.core(
    usage_interval_s=0.1,
    heartbeat_interval_s=0.2,
    fair_share="usage",
    fair_share_half_life_s=HALF_LIFE_S,
    fair_share_unit_cpu_s=UNIT_CPU_S,
)


def _ended(db: DB, ids: list[int]) -> bool:
    done = db.execute(
        "SELECT count(*) FROM core.tasks WHERE id = ANY(%s) AND state = 'succeeded'", (ids,)
    ).fetchone()
    return done is not None and done[0] == len(ids)


def _owners_in_claim_order(db: DB, ids: list[int]) -> list[str]:
    rows = db.execute(
        "SELECT t.owner FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id"
        " WHERE t.id = ANY(%s) ORDER BY a.id",
        (ids,),
    ).fetchall()
    return [r[0] for r in rows]


def _pushed_back(db: DB, owner: str) -> float:
    """The owner's push-back in fair-share steps, as a submission computes it now."""
    row = db.execute(
        "SELECT cpu_s * power(2, -extract(epoch FROM now() - at)::float8 / %s) / %s"
        " FROM core.fair_usage WHERE kind = 'owner' AND name = %s",
        (HALF_LIFE_S, UNIT_CPU_S, owner),
    ).fetchone()
    return float(row[0]) if row else 0.0


def _batch(client: Any) -> list[int]:
    """Three tasks in one submission: stamped one fair-share step apart."""
    answer = client.post("/v1/tasks/batch", json={"tasks": [spec(**TASK)] * 3})
    assert answer.status_code == 201, answer.text
    return [t["id"] for t in answer.json()["tasks"]]


def _both(core: Core, db: DB) -> list[str]:
    """hog's three tasks, then lamb's three, submitted while the queue is paused and
    released at once; the owners in the order the agent's claims took them."""
    with (
        core.client("root", "admin") as root,
        core.client("hog") as hog,
        core.client("lamb") as lamb,
    ):
        assert root.post("/v1/queues/default/pause").status_code == 200
        ids = _batch(hog) + _batch(lamb)
        assert root.post("/v1/queues/default/resume").status_code == 200
    wait_for(lambda: _ended(db, ids), timeout=30, seen=lambda: _where(db, ids))
    return _owners_in_claim_order(db, ids)


def _where(db: DB, ids: list[int]) -> list[tuple[Any, ...]]:
    """Each task's state, and its attempts' outcomes and errors (a wait's failure says)."""
    return db.execute(
        "SELECT t.id, t.owner, t.state, t.run_at, array_agg((a.outcome, a.error, a.worker_id)"
        " ORDER BY a.id) FILTER (WHERE a.id IS NOT NULL)"
        " FROM core.tasks t LEFT JOIN core.attempts a ON a.task_id = t.id"
        " WHERE t.id = ANY(%s) GROUP BY t.id ORDER BY t.id",
        (ids,),
    ).fetchall()


def test_recent_usage_is_served_last_and_decays_back_to_turns(
    core: Core, db: DB, tmp_path: Path
) -> None:
    # One attempt at a time: the claims' order is the attempts' order.
    agent = spawn_worker(core, tmp_path / "w", "w-fair", cpu=2, CAIRN_WORKER_SLOTS="1")
    try:
        with core.client("hog") as hog:
            burn = shell_spec(BURN, resources={"cpu": 2, "memory_mb": 64})
            first = [hog.post("/v1/tasks", json=burn).json()["id"]]
        wait_for(lambda: _ended(db, first), timeout=30)
        wait_for(lambda: _pushed_back(db, "hog") > 0, timeout=10)

        # The month's sums are the attempts' own measured figures.
        [(cpu_s, reserved_s, wall_s)] = db.execute(
            "SELECT a.cpu_seconds, a.charge_cpu * extract(epoch FROM a.ended_at - a.started_at),"
            " extract(epoch FROM a.ended_at - a.started_at)"
            " FROM core.attempts a WHERE a.task_id = %s",
            (first[0],),
        ).fetchall()
        assert 0.05 < cpu_s < float(wall_s), "the agent measured the burn's CPU"
        month = datetime.now(UTC).strftime("%Y-%m")
        with core.client("hog") as hog:
            answer = hog.get("/v1/usage/accounts", params={"month": month}).json()
        [mine] = answer["items"]
        assert (mine["key"], mine["attempts"]) == ("hog", 1)
        assert mine["cpu_s"] == pytest.approx(float(cpu_s), abs=1e-3)
        assert mine["cpu_reserved_s"] == pytest.approx(float(reserved_s), abs=1e-3)
        # The flow's usage is the same reservation, decayed from the attempt's end.
        [[undecayed]] = db.execute(
            "SELECT f.cpu_s * power(2, extract(epoch FROM f.at - a.ended_at)::float8 / %s)"
            " FROM core.fair_usage f, core.attempts a"
            " WHERE (f.kind, f.name) = ('owner', 'hog') AND a.task_id = %s",
            (HALF_LIFE_S, first[0]),
        ).fetchall()
        assert undecayed == pytest.approx(float(reserved_s), rel=1e-6)
        with core.client("hog") as hog:
            shown = hog.get("/v1/owners/hog/usage").json()["decayed_cpu_s"]
        assert 0 < shown <= float(reserved_s)

        # hog's reserved core-seconds push its work back: lamb's three go first.
        assert _pushed_back(db, "hog") > 10
        assert _both(core, db) == ["lamb"] * 3 + ["hog"] * 3

        # Decayed to under half a step each: the stamps decide again, one for one.
        wait_for(lambda: max(_pushed_back(db, o) for o in ("hog", "lamb")) < 0.4, timeout=40)
        # (Within a turn, which of the two goes first is the last tenths of a step.)
        order = _both(core, db)
        assert [sorted(order[i : i + 2]) for i in (0, 2, 4)] == [["hog", "lamb"]] * 3, order
    finally:
        stop_process(agent, signal.SIGKILL)


def test_a_queues_policy_chooses_its_fair_share_and_a_wrong_one_is_a_422(
    core: Core, db: DB
) -> None:
    """Core weighs usage; queue ``batch`` says ``tasks``: hog's 6 core-seconds push its
    work up to 6,000 steps back in ``default`` and not at all in ``batch``."""
    with core.client("root", "admin") as root:
        answer = root.put("/v1/queues/batch/policy", json={"fair_share": "tasks"})
        assert answer.status_code == 200, answer.text
        assert root.get("/v1/queues/batch/policy").json()["fair_share"] == "tasks"
        refused = root.put("/v1/queues/batch/policy", json={"fair_share": "bytes"})
    problem(refused, 422, "body.fair_share")
    db.execute("INSERT INTO core.fair_usage (kind, name, cpu_s) VALUES ('owner', 'hog', 6)")
    with core.client("hog") as hog:
        for queue in ("default", "batch"):
            assert hog.post("/v1/tasks", json=spec(queue=queue)).status_code == 201
    ahead = dict(
        db.execute(
            "SELECT queue, vtime - extract(epoch FROM created_at)::float8 FROM core.tasks"
        ).fetchall()
    )
    # (Decayed by the time it is read: halved each second here.)
    assert 6 / UNIT_CPU_S / 8 < ahead["default"] <= 6 / UNIT_CPU_S
    assert ahead["batch"] == pytest.approx(0, abs=0.01)
