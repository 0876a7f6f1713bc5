"""A turn's answer lost on the way back (core committed the lease; the connection broke
before the agent read it, as in a database failover or a load balancer's reset): a real
agent behind a proxy that drops the first answer carrying a lease. The agent's next turn
says what it holds, core hands the same attempt out again, and the task runs once, by one
attempt, well before the heartbeat would have declared the attempt lost."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen
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

Conn = psycopg.Connection[tuple[object, ...]]


def behind(proxy: Proxy, core: Core, tmp_path: Path, name: str, **kwargs: Any) -> Popen[bytes]:
    """A real agent that reaches core through ``proxy``."""
    via = Core(f"http://127.0.0.1:{proxy.port}", core.db_url, core.server, core.thread)
    return spawn_worker(via, tmp_path / "worker", name, **kwargs)


def state(db: Conn, task: int) -> str:
    row = db.execute("SELECT state FROM core.tasks WHERE id = %s", (task,)).fetchone()
    assert row is not None
    return str(row[0])


def ended(db: Conn, task: int) -> bool:
    return state(db, task) in ("succeeded", "failed", "dead")


class DroppingProxy(Proxy):
    """Once, closes the agent's connection instead of passing on the answer to a turn
    that leased work."""

    def __init__(self, backend: int) -> None:
        self.dropped: list[bytes] = []
        super().__init__(backend)

    def drop(self, head: bytes, answer: bytes) -> bool:
        turn = head.split(b" ", 2)[1].endswith(b"/turn")
        if turn and not self.dropped and b'"attempts":[{' in answer:
            self.dropped.append(answer)
            return True
        return False


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    # The heartbeat's default bounds: the attempt must come back by the agent's next
    # turn, not by the heartbeat declaring it lost.
    server = start_core(db_url, tmp_path / "core")
    yield server
    server.stop()


def test_a_lease_whose_answer_is_lost_runs_once_by_one_attempt(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    proxy = DroppingProxy(int(core.url.rsplit(":", 1)[1]))
    shared = shared_dir()
    agent = behind(proxy, core, tmp_path, "lost-answer-worker")
    try:
        with core.client("alice") as alice:
            body = shell_spec(f"echo ran >> {shared}/runs", retry={"max_attempts": 1})
            task = alice.post("/v1/tasks", json=body).json()["id"]
        began = time.monotonic()
        db.autocommit = True

        wait_for(lambda: ended(db, task), timeout=30)
        took = time.monotonic() - began
        final = state(db, task)
        attempts = db.execute(
            "SELECT count(*), min(outcome) FROM core.attempts WHERE task_id = %s", (task,)
        ).fetchone()
        assert len(proxy.dropped) == 1  # the lease's answer was lost
        assert final == "succeeded" and attempts == (1, "succeeded")
        assert (shared / "runs").read_text() == "ran\n"  # run once
        assert took < 15  # by the next turn, not the heartbeat's grace
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()


class ReportAnswerDropper(Proxy):
    """Once, closes the agent's connection instead of passing on the answer to a turn
    whose report core applied."""

    def __init__(self, backend: int) -> None:
        self.dropped: list[bytes] = []
        super().__init__(backend)

    def drop(self, head: bytes, answer: bytes) -> bool:
        turn = head.split(b" ", 2)[1].endswith(b"/turn")
        if turn and not self.dropped and b'"reports":[{' in answer:
            self.dropped.append(answer)
            return True
        return False


def test_a_report_whose_answer_is_lost_is_sent_again_and_refused_as_applied(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    """The agent cannot know whether a turn whose answer it never heard reached core, so
    it sends its reports again: core refuses the second one, having applied the first,
    and the agent says so at info, not as a warning of a report refused."""
    proxy = ReportAnswerDropper(int(core.url.rsplit(":", 1)[1]))
    shared = shared_dir()
    log = tmp_path / "agent.log"
    agent = behind(
        proxy, core, tmp_path, "lost-report-answer-worker", log=log, CAIRN_LOG_LEVEL="info"
    )
    try:
        with core.client("alice") as alice:
            body = shell_spec(f"echo ran >> {shared}/runs", retry={"max_attempts": 1})
            task = alice.post("/v1/tasks", json=body).json()["id"]
        db.autocommit = True
        wait_for(lambda: b"earlier turn" in log.read_bytes(), timeout=30)
        row = db.execute(
            "SELECT t.state, count(a.id), min(a.outcome) FROM core.tasks t"
            " JOIN core.attempts a ON a.task_id = t.id WHERE t.id = %s GROUP BY t.state",
            (task,),
        ).fetchone()
        assert len(proxy.dropped) == 1  # the report's answer was lost
        assert row == ("succeeded", 1, "succeeded")
        assert (shared / "runs").read_text() == "ran\n"  # run once
        lines = [json.loads(line) for line in log.read_text().splitlines() if line[:1] == "{"]
        told = [e for e in lines if "report of attempt" in e["message"]]
        assert [e["level"] for e in told] == ["info"]
        assert "(succeeded)" in told[0]["message"]
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()


class GarblingProxy(Proxy):
    """Once, passes a page of its own (a 200 that is not core's JSON, as a misconfigured
    gateway may) instead of core's answer to a turn that leased work."""

    PAGE = b"<html><body>gateway</body></html>"

    def __init__(self, backend: int) -> None:
        self.garbled: list[bytes] = []
        super().__init__(backend)

    def replace(self, head: bytes, answer: bytes) -> bytes | None:
        turn = head.split(b" ", 2)[1].endswith(b"/turn")
        if not turn or self.garbled or b'"attempts":[{' not in answer:
            return None
        self.garbled.append(answer)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n"
        return head % len(self.PAGE) + self.PAGE


def test_an_answer_the_agent_cannot_read_is_a_failed_turn_and_the_lease_runs_once(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    """A turn's answer the agent cannot read (core committed the lease; what came back
    is not its JSON) raised past the turn's handling: the agent ended, and its attempt
    waited for the heartbeat to call it lost. Now it is a failed turn like a lost
    answer: the agent goes on, says what it holds, gets the same attempt again and runs
    it once; the next task runs on the same agent."""
    proxy = GarblingProxy(int(core.url.rsplit(":", 1)[1]))
    shared = shared_dir()
    agent = behind(proxy, core, tmp_path, "garbled-answer-worker")
    db.autocommit = True

    try:
        with core.client("alice") as alice:
            # a file a task: each attempt runs as a uid of its own
            body = shell_spec(f"echo ran >> {shared}/first", retry={"max_attempts": 1})
            first = alice.post("/v1/tasks", json=body).json()["id"]
            wait_for(lambda: ended(db, first), timeout=30)
            assert agent.poll() is None, "the agent ended"
            body = shell_spec(f"echo ran >> {shared}/second", retry={"max_attempts": 1})
            second = alice.post("/v1/tasks", json=body).json()["id"]
            wait_for(lambda: ended(db, second), timeout=30)
        assert len(proxy.garbled) == 1
        attempts = db.execute(
            "SELECT task_id, count(*), min(outcome) FROM core.attempts GROUP BY task_id"
            " ORDER BY task_id"
        ).fetchall()
        assert attempts == [(first, 1, "succeeded"), (second, 1, "succeeded")]
        assert (shared / "first").read_text() == "ran\n"  # run once
        assert agent.poll() is None
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()
