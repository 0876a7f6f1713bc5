"""Room that grows while a claim waits, with a real worker agent: on a 600 MB agent, tasks
of 400 MB run one after the other. While the first runs, the agent's next claim waits at
core with the 200 MB it had; the first one's report (a turn of its own) frees 400 MB,
and the waiting claim leases the next task at once, not at the end of its wait."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import psycopg
import pytest

from tests.support import Core, Workers, shell_spec, start_core, wait_for


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(db_url, tmp_path / "core", heartbeat_interval_s=0.2)
    yield server
    server.stop()


def _attempts(db: psycopg.Connection[tuple[object, ...]]) -> list[tuple[float, float | None]]:
    """Each attempt's start and end (epoch seconds), in the order they started."""
    rows = db.execute(
        "SELECT extract(epoch FROM started_at)::float8, extract(epoch FROM ended_at)::float8"
        " FROM core.attempts ORDER BY started_at"
    ).fetchall()
    return [(float(s), None if e is None else float(e)) for s, e in rows]  # type: ignore[arg-type]


def test_a_waiting_claim_leases_what_fits_once_a_report_frees_its_room(
    core: Core, workers: Workers, tmp_path: Path, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    workers.start(core, tmp_path / "w", "w", cpu=4, memory_mb=600, CAIRN_WORKER_SLOTS="4")
    big = shell_spec("sleep 0.3", resources={"cpu": 1, "memory_mb": 400})
    with core.client("root", "admin") as admin, core.client() as alice:
        wait_for(lambda: admin.get("/v1/workers").json()["items"])
        tasks = [alice.post("/v1/tasks", json=big).json()["id"] for _ in range(3)]
        # A stale room held each next attempt back for the claim's whole wait (30 s
        # here): the second start says how long.
        wait_for(lambda: len(_attempts(db)) >= 2, timeout=40)
        (_, ended), (started, _) = _attempts(db)[:2]
        assert ended is not None
        assert started - ended < 2.0, f"the second attempt started {started - ended:.1f} s late"
        wait_for(lambda: len(_attempts(db)) == 3 and _attempts(db)[-1][1], timeout=10)
        states = [alice.get(f"/v1/tasks/{t}").json()["state"] for t in tasks]
        assert states == ["succeeded"] * 3
    runs = _attempts(db)
    for (_, ended), (started, _) in pairwise(runs):
        assert ended is not None
        assert started >= ended - 0.05  # never two at once: 800 MB do not fit in 600
        assert started - ended < 2.0, f"the next attempt started {started - ended:.1f} s late"
