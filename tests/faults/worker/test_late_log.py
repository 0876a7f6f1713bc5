"""The end of a log when core is slow (docs/logs.md, "When core is slow"): a real agent
behind a proxy that holds every log request 1.5 s, far longer than the agent waits
(``CAIRN_WORKER_LOG_FLUSH_S`` 0.3 s) before it reports the attempt's end. The report goes
first and says how long the output was; the chunks that reach core after it are taken,
and the log core holds is the task's whole output, complete, where the end used to be
refused (the attempt had ended) and lost for good. Behind a core older than
``log_bytes`` (it refuses the field: 422), the agent sends the report again without it,
and every report after (docs/deploy.md)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import psycopg
import pytest

from tests.support import Core, shell_spec, spawn_worker, stop_process, wait_for
from tests.support.httpproxy import Proxy

pytestmark = pytest.mark.slow

LINES = 300
SCRIPT = f"echo start; sleep 1; seq 1 {LINES}"
OUTPUT = "start\n" + "".join(f"{i}\n" for i in range(1, LINES + 1))


class SlowLogs(Proxy):
    """Holds each ``POST .../logs`` for ``delay_s`` before core sees it."""

    def __init__(self, backend: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self.held = 0
        super().__init__(backend)

    async def hold(self, head: bytes) -> None:
        if head.split(b" ", 2)[1].endswith(b"/logs"):
            self.held += 1
            await asyncio.sleep(self.delay_s)


def _agent_behind(proxy: Proxy, core: Core, tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    """A real agent whose calls go through ``proxy``, waiting 0.3 s for a log's end."""
    return spawn_worker(
        Core(proxy.url, core.db_url, core.server, core.thread),
        tmp_path / "worker",
        name,
        CAIRN_WORKER_LOG_FLUSH_S="0.3",
    )


def test_the_end_of_a_log_that_reaches_core_after_the_report_is_kept(
    core: Core, tmp_path: Path, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    proxy = SlowLogs(int(core.url.rsplit(":", 1)[1]), delay_s=1.5)
    agent = _agent_behind(proxy, core, tmp_path, "late-log-worker")
    db.autocommit = True
    try:
        with core.client("alice") as alice:
            task = alice.post("/v1/tasks", json=shell_spec(SCRIPT)).json()["id"]

            def ended() -> bool:
                return alice.get(f"/v1/tasks/{task}").json()["state"] == "succeeded"

            wait_for(ended, timeout=30)
            log = wait_for(
                lambda: (
                    (r := alice.get(f"/v1/tasks/{task}/logs")).headers["x-cairn-log-complete"]
                    == "true"
                    and r
                ),
                timeout=30,
            )
        assert log.text == OUTPUT
        stored = db.execute(
            "SELECT string_agg(c.content, '' ORDER BY c.pos) FROM core.log_chunks c"
            " JOIN core.attempts a ON a.id = c.attempt_id WHERE a.task_id = %s",
            (task,),
        ).fetchone()
        assert stored == (OUTPUT,)
        # The report went while the end was held: it said how long the output was.
        row = db.execute("SELECT log_bytes FROM core.attempts WHERE task_id = %s", (task,))
        assert row.fetchone() == (len(OUTPUT),)
        assert proxy.held >= 2  # the end came in more than the one request held at the report
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()


class OlderCore(SlowLogs):
    """Also refuses, as a core that predates ``log_bytes`` does (unknown fields are 422),
    each turn whose reports carry it; passes the rest on."""

    def __init__(self, backend: int, delay_s: float) -> None:
        self.refused = 0
        self.passed = 0  # turns with reports passed on
        super().__init__(backend, delay_s)

    async def answer(self, head: bytes, body: bytes) -> bytes | None:
        if not head.split(b" ", 2)[1].endswith(b"/turn"):
            return None
        reports = json.loads(body).get("reports", [])
        unknown = [
            {"field": f"body.reports.{i}.log_bytes", "reason": "Extra inputs are not permitted"}
            for i, report in enumerate(reports)
            if "log_bytes" in report
        ]
        if not unknown:
            self.passed += bool(reports)
            return None
        self.refused += 1
        problem = {
            "type": "https://cairn.dev/problems/invalid-input", "title": "Invalid input",
            "status": 422, "detail": f"{unknown[0]['field']}: {unknown[0]['reason']}",
            "errors": unknown,
        }  # fmt: skip
        answer = json.dumps(problem).encode()
        head = b"HTTP/1.1 422 Unprocessable Entity\r\ncontent-type: application/problem+json\r\n"
        return head + f"content-length: {len(answer)}\r\n\r\n".encode() + answer


def test_an_older_core_that_refuses_log_bytes_gets_the_report_without_it(
    core: Core, tmp_path: Path, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    proxy = OlderCore(int(core.url.rsplit(":", 1)[1]), delay_s=1.5)
    agent = _agent_behind(proxy, core, tmp_path, "older-core-worker")
    db.autocommit = True
    try:
        with core.client("alice") as alice:
            for _ in range(2):  # the second's report goes without it from the start
                task = alice.post("/v1/tasks", json=shell_spec(SCRIPT)).json()["id"]
                wait_for(
                    lambda t=task: alice.get(f"/v1/tasks/{t}").json()["state"] == "succeeded",
                    timeout=30,
                )
        row = db.execute("SELECT count(*), count(log_bytes) FROM core.attempts")
        assert row.fetchone() == (2, 0)  # core never saw the field
        assert proxy.held >= 2  # both reports went while their log's end was held
        assert proxy.refused == 1 and proxy.passed >= 2, (proxy.refused, proxy.passed)
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()
