"""A real agent drained (SIGTERM) while its claim waits at core, that claim carrying the
report of an attempt that just ended (core applied it before the claim began to wait):
the agent tells core it drains, core answers that claim at once with nothing leased,
and the agent hears the answer, so no report goes twice. Core leases nothing more to
the worker while it drains, and it leaves when its last attempt has ended. When core
does not hear the drain's turn (one that predates ``Turn.draining`` refuses it), the
agent gives its claim up at once, as before; when the drain's turn's answer is lost, the
reports it carried go again by the courier."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import (
    Core,
    shared_dir,
    shell_spec,
    spawn_worker,
    start_core,
    stop_process,
    wait_for,
)
from tests.support.httpproxy import Proxy

pytestmark = pytest.mark.slow

DB = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    # The heartbeat's default bounds: the agent's claims wait at core a long time.
    server = start_core(db_url, tmp_path / "core")
    yield server
    server.stop()


def _one(db: DB, query: str, *args: object) -> Any:
    row = db.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def _waiting(core: Core) -> int:
    """How many claims wait in core's line (``cairn_claims_waiting``)."""
    app: Any = core.server.config.app
    return len(app.state.notifier.line)


def _lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.read_text().splitlines() if x[:1] == "{"]


def _at(lines: list[dict[str, Any]], words: str) -> datetime:
    """When the agent first logged a line with ``words``."""
    [first, *_] = [e for e in lines if words in e["message"]]
    return datetime.fromisoformat(str(first.get("asctime", first.get("time"))))


def _turn(head: bytes) -> bytes | None:
    """The path of a worker's turn (None for any other request)."""
    path = head.split(b" ", 2)[1]
    return path if path.endswith(b"/turn") else None


def _problem(status: int, detail: str) -> bytes:
    body = json.dumps({"type": "about:blank", "status": status, "detail": detail}).encode()
    head = f"HTTP/1.1 {status} No\r\ncontent-type: application/problem+json\r\n"
    return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body


def _reached(predicate: Any, timeout: float) -> bool:
    try:
        wait_for(predicate, timeout=timeout)
    except AssertionError:
        return False
    return True


def test_a_drain_while_a_claim_waits_hears_its_answer_and_sends_no_report_twice(
    core: Core, tmp_path: Path, db: DB
) -> None:
    db.autocommit = True
    go = shared_dir() / "go"
    retry = {"retry": {"max_attempts": 1}}
    with core.client("alice") as alice:
        # Submitted before the agent starts: its first claim (room for two) leases both.
        long = alice.post(
            "/v1/tasks", json=shell_spec(f"while [ ! -e {go} ]; do sleep 0.05; done", **retry)
        ).json()["id"]
        quick = alice.post("/v1/tasks", json=shell_spec("true", **retry)).json()["id"]
    log = tmp_path / "agent.log"
    agent = spawn_worker(
        core, tmp_path / "worker", "drain-worker", log=log,
        CAIRN_WORKER_SLOTS="2", CAIRN_WORKER_DRAIN_GRACE_S="30", CAIRN_LOG_LEVEL="info",
    )  # fmt: skip
    try:
        # The quick one's report rode on the agent's next claim (it was full until
        # then), which core applied, found no work for, and holds as a long poll.
        ended = "SELECT count(*) FROM core.attempts WHERE task_id = %s AND outcome = 'succeeded'"
        wait_for(lambda: _one(db, ended, quick) == 1, timeout=30)
        wait_for(lambda: _waiting(core) == 1, timeout=30)  # that claim is in core's line
        agent.send_signal(signal.SIGTERM)
        state = "SELECT state FROM core.workers"
        draining = _reached(lambda: _one(db, state) == "draining", timeout=10)
        with core.client("alice") as alice:
            # Work for the worker's queue while it drains: it must not get it.
            late = alice.post("/v1/tasks", json=shell_spec("true", **retry)).json()["id"]
        time.sleep(0.5)  # the announcement reached core's line
        go.touch()  # the long one ends within the grace
        code = agent.wait(timeout=40)
        lines = [json.loads(x) for x in log.read_text().splitlines() if x[:1] == "{"]
    finally:
        stop_process(agent, signal.SIGKILL)
    told = [e["message"] for e in lines if "report of attempt" in e["message"]]
    attempts = db.execute(
        "SELECT task_id, outcome FROM core.attempts ORDER BY task_id, id"
    ).fetchall()
    print(
        "EVIDENCE",
        code,
        draining,
        attempts,
        _one(db, "SELECT state FROM core.tasks WHERE id = %s", late),
        _one(db, state),
    )
    [print(e.get("asctime", e.get("time")), e["level"], e["message"]) for e in lines]
    assert code == 0
    assert told == []  # no report was sent twice (nor refused)
    assert draining  # core knew the worker drained while its last attempt ran
    # Each task ran once, by one attempt; the late one was leased nothing.
    assert attempts == [(long, "succeeded"), (quick, "succeeded")]
    assert _one(db, "SELECT state FROM core.tasks WHERE id = %s", late) == "waiting"
    assert _one(db, state) == "left"


class OlderCore(Proxy):
    """Refuses a turn that says its worker drains as a core that predates
    ``Turn.draining`` does (422: it refuses unknown fields); passes the rest on."""

    def __init__(self, backend: int) -> None:
        self.refused = 0
        super().__init__(backend)

    async def answer(self, head: bytes, body: bytes) -> bytes | None:
        if _turn(head) is None or b'"draining":true' not in body:
            return None
        self.refused += 1
        return _problem(422, "body.draining: Extra inputs are not permitted")


def test_a_drain_that_core_does_not_hear_gives_its_waiting_claim_up_at_once(
    core: Core, tmp_path: Path, db: DB
) -> None:
    """Core refused the drain's turn, so it will not answer the claim waiting there
    before that claim's wait is over: the agent gives it up at once, not after
    ``DRAIN_ANSWER_S`` (which delayed every drain against such a core by 5 s)."""
    db.autocommit = True
    proxy = OlderCore(int(core.url.rsplit(":", 1)[1]))
    log = tmp_path / "agent.log"
    agent = spawn_worker(
        Core(f"http://127.0.0.1:{proxy.port}", core.db_url, core.server, core.thread),
        tmp_path / "worker", "older-core-worker", log=log, CAIRN_LOG_LEVEL="info",
    )  # fmt: skip
    try:
        wait_for(lambda: _waiting(core) == 1, timeout=30)  # its claim waits at core
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=40)
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()
    lines = _lines(log)
    [print(e.get("asctime", e.get("time")), e["level"], e["message"]) for e in lines]
    refused = _at(lines, "turn failed: body.draining")
    gave_up = _at(lines, "core did not answer the claim of a draining worker")
    print("EVIDENCE", code, proxy.refused, (gave_up - refused).total_seconds())
    assert code == 0 and proxy.refused == 1
    assert (gave_up - refused).total_seconds() < 2.5  # DRAIN_ANSWER_S (5) before
    assert _one(db, "SELECT state FROM core.workers") == "left"


class LostDrainAnswer(Proxy):
    """Refuses (503) the turns that carry reports without a claim until the agent drains,
    so its courier backs off with a report waiting; passes the drain's turn on to core,
    then loses its answer after ``HELD_S`` (longer than the courier's back-off then)."""

    HELD_S = 3.0

    def __init__(self, backend: int) -> None:
        self.refused = 0
        self.lost: list[str] = []
        super().__init__(backend)

    async def answer(self, head: bytes, body: bytes) -> bytes | None:
        path = _turn(head)
        if path is None:
            return None
        if b'"draining":true' in body and not self.lost:
            fields = (line.split(b":", 1) for line in head.split(b"\r\n")[1:] if line)
            keep = (b"authorization", b"x-cairn-worker-lease", b"content-type")
            headers = {k.decode(): v.strip().decode() for k, v in fields if k.lower() in keep}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.backend}") as client:
                applied = await client.post(path.decode(), content=body, headers=headers)
            self.lost.append(applied.text)
            await asyncio.sleep(self.HELD_S)
            return b""  # core applied it; its answer never arrives
        if not self.lost and b'"claim":null' in body and b'"reports":[{' in body:
            self.refused += 1
            return _problem(503, "core is busy")
        return None


def test_the_reports_of_a_drain_whose_answer_is_lost_go_again_at_once(
    core: Core, tmp_path: Path, db: DB
) -> None:
    """The drain's turn took the report the courier was backing off with; the courier
    found none left and ended; that turn's answer lost, the report goes again by a
    courier at once (refused as applied), not by a keep-alive turn an eighth of the hang
    bound later (37.5 s), which held the drain that long."""
    db.autocommit = True
    proxy = LostDrainAnswer(int(core.url.rsplit(":", 1)[1]))
    go = shared_dir() / "go"
    with core.client("alice") as alice:
        body = shell_spec(f"while [ ! -e {go} ]; do sleep 0.05; done", retry={"max_attempts": 1})
        task = alice.post("/v1/tasks", json=body).json()["id"]
    log = tmp_path / "agent.log"
    agent = spawn_worker(
        Core(f"http://127.0.0.1:{proxy.port}", core.db_url, core.server, core.thread),
        tmp_path / "worker", "lost-drain-worker", log=log,
        CAIRN_WORKER_SLOTS="2", CAIRN_LOG_LEVEL="info",
    )  # fmt: skip
    try:
        wait_for(lambda: _waiting(core) == 1, timeout=30)  # its next claim waits at core
        go.touch()  # the attempt ends: the courier sends its report, and backs off
        wait_for(lambda: proxy.refused >= 4, timeout=30)
        agent.send_signal(signal.SIGTERM)
        try:
            code: int | None = agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()
    lines = _lines(log)
    [print(e.get("asctime", e.get("time")), e["level"], e["message"]) for e in lines]
    attempts = db.execute("SELECT task_id, outcome FROM core.attempts").fetchall()
    print("EVIDENCE", code, proxy.refused, proxy.lost, attempts)
    assert len(proxy.lost) == 1 and '"state":"draining"' in proxy.lost[0]
    assert '"reports":[{' in proxy.lost[0]  # the drain's turn carried the report
    assert code == 0  # within 20 s of the SIGTERM
    assert any("applied by an earlier turn" in e["message"] for e in lines)
    assert attempts == [(task, "succeeded")]
    assert _one(db, "SELECT state FROM core.workers") == "left"
