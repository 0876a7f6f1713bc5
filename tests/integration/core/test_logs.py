"""Live logs in core (docs/logs.md): a worker ships chunks while its attempt runs; they are
readable at once, fenced by the worker's lease and the attempt's being open, not doubled
when a batch is sent again, bounded per attempt, and followed as server-sent events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from libs.common.settings import libpq_url
from tests.fixtures.logs import follow_log
from tests.support import Core, register_worker, spec, start_core, wait_for

OFFER = {"hostname": "logs.test", "queues": ["default"], "cpu": 64, "memory_mb": 65536}


class Shipper:
    """A worker as core sees it: registered, holding the attempts it claims."""

    def __init__(self, core: Core, name: str = "log-worker") -> None:
        self.http = core.client(name, "worker")
        self.id = register_worker(self.http, OFFER)

    def claim(self) -> dict:
        room = {"cpu": 8, "memory_mb": 16384, "max": 1, "wait": 5}
        [attempt] = self.http.post(f"/v1/workers/{self.id}/claim", json=room).json()["attempts"]
        return attempt

    def ship(self, *chunks: tuple[int, int, str]) -> httpx.Response:
        body = {
            "chunks": [
                {"attempt_id": a, "offset": o, "length": len(t.encode()), "text": t}
                for a, o, t in chunks
            ]
        }
        return self.http.post(f"/v1/workers/{self.id}/logs", json=body)

    def report(self, attempt_id: int, log_bytes: int | None = None) -> None:
        """Succeeded; ``log_bytes``: the end of its log is still on its way."""
        path = f"/v1/workers/{self.id}/attempts/{attempt_id}/report"
        body = {"outcome": "succeeded", "exit_code": 0, "log_bytes": log_bytes}
        self.http.post(path, json=body).raise_for_status()


@pytest.fixture
def shipper(core: Core) -> Iterator[Shipper]:
    made = Shipper(core)
    yield made
    made.http.close()


def _running(core: Core, shipper: Shipper) -> tuple[int, int]:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
    attempt = shipper.claim()
    return task["id"], attempt["attempt_id"]


def test_a_running_attempts_chunks_are_readable_at_once_and_a_retried_batch_is_not_doubled(
    core: Core, shipper: Shipper
) -> None:
    task_id, attempt = _running(core, shipper)
    first = shipper.ship((attempt, 0, "one\n"), (attempt, 4, "two\n"))
    assert first.status_code == 200, first.text
    assert [a["status"] for a in first.json()["items"]] == [200, 200]
    assert first.json()["items"][-1]["next_offset"] == 8
    again = shipper.ship((attempt, 0, "one\n"), (attempt, 4, "two\n"), (attempt, 8, "three\n"))
    assert [a["next_offset"] for a in again.json()["items"]] == [8, 8, 14]
    with core.client() as alice, core.client("bob") as bob:
        log = alice.get(f"/v1/tasks/{task_id}/logs")
        assert bob.get(f"/v1/tasks/{task_id}/logs").status_code == 404
        rest = alice.get(f"/v1/tasks/{task_id}/logs", params={"offset": 4})
    assert log.status_code == 200, log.text
    assert log.text == "one\ntwo\nthree\n"
    assert log.headers["x-cairn-attempt"] == str(attempt)
    assert log.headers["x-cairn-log-complete"] == "false"
    assert log.headers["x-cairn-log-offset"] == "14"
    assert rest.text == "two\nthree\n"


def test_a_stale_workers_chunks_are_refused_chunk_by_chunk(core: Core, shipper: Shipper) -> None:
    task_id, attempt = _running(core, shipper)
    _, other = _running(core, shipper)
    shipper.report(attempt)  # ended: nothing more is appended
    with core.client("intruder", "worker") as http:
        intruder = register_worker(http, OFFER)
        forged = http.post(
            f"/v1/workers/{intruder}/logs",
            json={"chunks": [{"attempt_id": other, "offset": 0, "length": 2, "text": "x\n"}]},
        )
    answer = shipper.ship((attempt, 0, "late\n"), (other, 0, "fine\n"))
    assert answer.status_code == 200, answer.text
    stale, fine = answer.json()["items"]
    assert stale["status"] == 409 and f"attempt {attempt}" in stale["detail"]
    assert fine["status"] == 200
    assert forged.json()["items"][0]["status"] == 409
    with core.client() as alice:
        assert alice.get(f"/v1/tasks/{task_id}/logs").text == ""
    # A lost lease (the worker left: its attempts are lost) refuses the same way.
    shipper.http.post(f"/v1/workers/{shipper.id}/leave").raise_for_status()
    gone = shipper.ship((other, 5, "after\n"))
    assert gone.status_code == 200 and gone.json()["items"][0]["status"] == 409


def test_an_attempts_log_keeps_its_last_bytes_under_the_cap_with_a_marker(
    db_url: str, tmp_path: Path
) -> None:
    core = start_core(db_url, tmp_path / "core", log_max_bytes=1024 * 1024)
    try:
        shipper = Shipper(core)
        task_id, attempt = _running(core, shipper)
        line = "x" * 1023 + "\n"
        for i in range(40):  # 40 chunks of 32 KiB: 1.25 MiB
            answer = shipper.ship((attempt, i * 32768, line * 32))
            assert answer.json()["items"][0]["status"] == 200
        with core.client() as alice:
            log = alice.get(f"/v1/tasks/{task_id}/logs")
        shipper.http.close()
    finally:
        core.stop()
    assert log.headers["x-cairn-log-truncated"] == "true"
    marker, _, kept = log.text.partition("\n")
    assert marker.startswith("[cairn: the first ") and "last 1 MiB" in marker
    assert 1024 * 1024 - 32768 <= len(kept) <= 1024 * 1024 + 32768
    assert kept == line * (len(kept) // len(line))


def test_skipped_output_is_marked_where_it_was(core: Core, shipper: Shipper) -> None:
    task_id, attempt = _running(core, shipper)
    shipper.ship((attempt, 0, "start\n"), (attempt, 1000, "end\n"))
    with core.client() as alice:
        log = alice.get(f"/v1/tasks/{task_id}/logs")
    assert log.text == "start\n[cairn: 994 bytes of output skipped by the worker]\nend\n"
    assert log.headers["x-cairn-log-truncated"] == "true"


def test_follow_streams_each_chunk_as_it_is_stored_and_ends_with_the_attempt(
    core: Core, shipper: Shipper
) -> None:
    task_id, attempt = _running(core, shipper)
    events: list[tuple[str, dict]] = []
    reader = follow_log(core, task_id, events)
    offset = 0
    for i in range(3):
        text = f"line {i}\n"
        shipper.ship((attempt, offset, text))
        offset += len(text)
        wait_for(lambda n=i: len(events) == n + 1, timeout=10)
        assert events[-1] == ("log", {**events[-1][1], "text": text})
    shipper.report(attempt)
    reader.join(timeout=10)
    assert not reader.is_alive()
    name, end = events[-1]
    assert name == "end"
    assert end == {
        "attempt_id": attempt,
        "outcome": "succeeded",
        "next_offset": offset,
        "task_state": "succeeded",
    }
    with core.client() as alice:
        # Resuming from an event's id gives what came after it; another task's attempt is
        # a 404 before any stream starts.
        again = alice.get(
            f"/v1/tasks/{task_id}/logs",
            params={"follow": "true"},
            headers={"Last-Event-ID": f"{attempt}:{events[0][1]['next_offset']}"},
        )
        elsewhere = alice.get(
            f"/v1/tasks/{task_id}/logs", params={"follow": "true", "attempt_id": attempt + 99}
        )
    assert "line 0" not in again.text and "line 1" in again.text and "event: end" in again.text
    assert elsewhere.status_code == 404


def test_a_task_without_an_attempt_has_no_log_yet(core: Core) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(queue="nobody-serves")).json()
        answer = alice.get(f"/v1/tasks/{task['id']}/logs")
    assert answer.status_code == 404
    assert "no attempt yet" in answer.json()["detail"]


def test_a_log_grows_past_32_kib_in_small_chunks(core: Core, shipper: Shipper) -> None:
    task_id, attempt = _running(core, shipper)
    line = "y" * 999 + "\n"
    for i in range(40):
        assert shipper.ship((attempt, i * 1000, line)).json()["items"][0]["status"] == 200
    with core.client() as alice:
        log = alice.get(f"/v1/tasks/{task_id}/logs")
    assert log.text == line * 40 and log.headers["x-cairn-log-offset"] == "40000"


def test_a_log_is_deleted_with_its_task_by_the_retention_purge(db_url: str, tmp_path: Path) -> None:
    core = start_core(db_url, tmp_path / "core", retention_days=1, retention_interval_s=0.2)
    try:
        shipper = Shipper(core)
        task_id, attempt = _running(core, shipper)
        shipper.ship((attempt, 0, "kept a while\n"))
        shipper.report(attempt)
        shipper.http.close()
        with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
            count = "SELECT count(*) FROM core.log_chunks WHERE attempt_id = %s"
            assert conn.execute(count, (attempt,)).fetchone() == (1,)
            conn.execute(
                "UPDATE core.tasks SET finished_at = now() - interval '2 days' WHERE id = %s",
                (task_id,),
            )
            wait_for(lambda: conn.execute(count, (attempt,)).fetchone() == (0,))
            heads = "SELECT count(*) FROM core.attempt_logs WHERE attempt_id = %s"
            assert conn.execute(heads, (attempt,)).fetchone() == (0,)
    finally:
        core.stop()


@pytest.mark.core(token_cache_s=0.2)
def test_a_followed_log_ends_for_a_member_removed_from_its_team(
    core: Core, shipper: Shipper
) -> None:
    """A followed log was authorised once, when its stream began: a member removed from
    the task's team (or whose token was revoked) read the log on for as long as the
    attempt ran, days for a service's replica. The stream ends without its ``end`` once
    the caller no longer may read the task, and following again is the 404."""
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
        for member in ("alice", "bob"):
            assert root.put(f"/v1/teams/sre/members/{member}").status_code == 200
    with core.client("alice") as alice:
        task_id = alice.post("/v1/tasks", json=spec(team="sre")).json()["id"]
    attempt = shipper.claim()["attempt_id"]
    events: list[tuple[str, dict]] = []
    reader = follow_log(core, task_id, events, "bob")
    shipper.ship((attempt, 0, "before\n"))
    wait_for(lambda: len(events) == 1, timeout=10)
    with core.client("root", "admin") as root:
        assert root.delete("/v1/teams/sre/members/bob").status_code == 200
    reader.join(timeout=20)
    assert not reader.is_alive()
    shipper.ship((attempt, 7, "after\n"))
    assert [name for name, _ in events] == ["log"]  # no end: the attempt runs on
    with core.client("bob") as bob:
        path = f"/v1/tasks/{task_id}/logs"
        assert bob.get(path, params={"follow": "true"}).status_code == 404
    with core.client("alice") as alice:
        assert alice.get(path).text == "before\nafter\n"
