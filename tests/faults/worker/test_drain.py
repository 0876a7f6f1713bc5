"""A real agent drained (SIGTERM) while its claim waits at core, that claim carrying the
report of an attempt that just ended (core applied it before the claim began to wait):
the agent tells core it drains, core answers that claim at once with nothing leased,
and the agent hears the answer, so no report goes twice. Core leases nothing more to
the worker while it drains, and it leaves when its last attempt has ended. When core
does not hear the drain's turn (one that predates ``Turn.draining`` refuses it), the
agent gives its claim up at once, as before."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

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
    return len(core.server.config.app.state.notifier.line)


def _lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.read_text().splitlines() if x[:1] == "{"]


def _at(lines: list[dict[str, Any]], words: str) -> datetime:
    """When the agent first logged a line with ``words``."""
    [first, *_] = [e for e in lines if words in e["message"]]
    return datetime.fromisoformat(first.get("asctime", first.get("time")))


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
        time.sleep(0.2)  # the claim waits in core's line
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
