"""Progress, checkpoints and fencing tokens through a real worker agent (attempts under
uids of their own) and a real core: a task writes progress and a checkpoint, its process
is killed, the next attempt finds the checkpoint; its fencing token is current while it
runs and not once it is superseded; a task that stops writing progress is ended."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.support import (
    Core,
    free_port,
    serve_in_thread,
    shared_dir,
    shell_spec,
    spawn_worker,
    start_core,
    stop_process,
)
from tests.support import wait_for as _wait_for

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    return _wait_for(predicate, timeout=timeout, interval=0.05)


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(
        db_url, tmp_path / "core", heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0
    )
    yield server
    server.stop()


@pytest.fixture
def agent(core: Core, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = spawn_worker(
        core,
        tmp_path / "worker",
        "progress-worker",
        CAIRN_WORKER_PROGRESS_POLL_S="0.1",
        CAIRN_WORKER_PROGRESS_INTERVAL_S="0.2",
    )
    yield proc
    stop_process(proc, signal.SIGKILL)


def fence(core: Core, token: str) -> httpx.Response:
    """The fencing check as a task makes it: no bearer token, only its own."""
    return httpx.post(f"{core.url}/v1/fencing", json={"token": token}, timeout=10)


RESUMING = r"""
S=@SHARED@
echo "$CAIRN_FENCING_TOKEN" > $S/token-$CAIRN_ATTEMPT_NUMBER
echo "$CAIRN_FENCING_URL" > $S/url
if [ -n "$CAIRN_CHECKPOINT" ]; then
    cp "$CAIRN_CHECKPOINT" $S/got
    printf '{"fraction": 1, "message": "resumed from %s"}' "$(cat "$CAIRN_CHECKPOINT")" \
        > "$CAIRN_PROGRESS.tmp"
    mv "$CAIRN_PROGRESS.tmp" "$CAIRN_PROGRESS"
    while [ ! -e $S/go ]; do sleep 0.05; done
    exit 0
fi
printf '{"fraction": 0.5, "message": "half way"}' > "$CAIRN_PROGRESS.tmp"
mv "$CAIRN_PROGRESS.tmp" "$CAIRN_PROGRESS"
printf 'step=7' > "$CAIRN_CHECKPOINT_OUT.tmp"
mv "$CAIRN_CHECKPOINT_OUT.tmp" "$CAIRN_CHECKPOINT_OUT"
echo $$ > $S/pid
sleep 60
"""


def test_a_checkpoint_reaches_the_next_attempt_after_a_crash_and_fences_the_old_one(
    core: Core, agent: subprocess.Popen[bytes], db: psycopg.Connection
) -> None:
    shared = shared_dir()
    script = RESUMING.replace("@SHARED@", str(shared))
    with core.client() as alice:
        task = alice.post(
            "/v1/tasks",
            json=shell_spec(script, retry={"max_attempts": 3, "base_s": 0.1, "jitter": False}),
        ).json()

        def progress() -> dict:
            return alice.get(f"/v1/tasks/{task['id']}").json()["progress"] or {}

        # What the running attempt wrote reaches core while it runs.
        wait_for(lambda: progress().get("checkpoint_bytes") == 6 and (shared / "pid").exists())
        live = progress()
        assert live["fraction"] == 0.5 and live["message"] == "half way"
        first = (shared / "token-1").read_text().strip()
        assert (shared / "url").read_text().strip() == f"{core.url}/v1/fencing"
        answer = fence(core, first)
        assert answer.status_code == 200
        assert answer.json() == {
            "current": True,
            "task_id": task["id"],
            "attempt_id": int(first.split(".")[0]),
            "epoch": 1,
        }
        # A token with another secret is no token at all; a malformed one is a 422.
        forged = first[:-1] + ("0" if first[-1] != "0" else "1")
        assert fence(core, forged).status_code == 404
        bad = fence(core, "1.1.xyz")
        assert bad.status_code == 422 and "token" in bad.text

        os.kill(int((shared / "pid").read_text()), signal.SIGKILL)

        wait_for(lambda: (shared / "got").exists() and (shared / "token-2").exists())
        assert (shared / "got").read_bytes() == b"step=7"
        second = (shared / "token-2").read_text().strip()
        # The new attempt is current; the one it superseded is not.
        assert fence(core, second).json()["current"] is True
        assert fence(core, second).json()["epoch"] == 2
        assert fence(core, first).json()["current"] is False
        wait_for(lambda: progress().get("message") == "resumed from step=7")

        (shared / "go").touch()
        wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "succeeded")
        attempts = alice.get(f"/v1/tasks/{task['id']}/attempts").json()["items"]
        final = progress()
    assert [a["outcome"] for a in attempts] == ["crashed", "succeeded"]
    assert final["fraction"] == 1.0 and final["attempt_id"] == attempts[1]["id"]
    assert fence(core, second).json()["current"] is False  # its task has finished
    row = db.execute(
        "SELECT attempt_id, checkpoint, checkpoint_attempt_id, fraction, message"
        " FROM core.task_progress WHERE task_id = %s",
        (task["id"],),
    ).fetchone()
    assert row == (attempts[1]["id"], b"step=7", attempts[0]["id"], 1.0, "resumed from step=7")


def test_no_progress_for_the_bound_ends_the_attempt_and_writes_keep_it_alive(
    core: Core, agent: subprocess.Popen[bytes], db: psycopg.Connection
) -> None:
    once = 'printf \'{"fraction": 0.1}\' > "$CAIRN_PROGRESS"; sleep 30'
    steady = (
        "for i in 1 2 3 4 5 6 7 8; do "
        'printf \'{"fraction": %s, "message": "step %s"}\' "0.$i" "$i" > "$CAIRN_PROGRESS"; '
        "sleep 0.3; done"
    )
    too_big = 'head -c 70000 /dev/zero > "$CAIRN_CHECKPOINT_OUT"; sleep 0.5'
    once_retry = {"max_attempts": 1}
    with core.client() as alice:
        stalled = alice.post(
            "/v1/tasks", json=shell_spec(once, progress_timeout_s=1, retry=once_retry)
        ).json()
        alive = alice.post(
            "/v1/tasks", json=shell_spec(steady, progress_timeout_s=1, retry=once_retry)
        ).json()
        big = alice.post("/v1/tasks", json=shell_spec(too_big, retry=once_retry)).json()
        ids = [stalled["id"], alive["id"], big["id"]]

        def states() -> list[str]:
            return [alice.get(f"/v1/tasks/{i}").json()["state"] for i in ids]

        wait_for(lambda: states() == ["dead", "succeeded", "succeeded"])
        [ended] = alice.get(f"/v1/tasks/{stalled['id']}/attempts").json()["items"]
        shown = alice.get(f"/v1/tasks/{alive['id']}").json()
        big_log = alice.get(f"/v1/tasks/{big['id']}/logs").text
    assert ended["outcome"] == "timeout"
    assert "no progress for 1 s" in ended["error"]
    assert shown["progress_timeout_s"] == 1
    assert shown["progress"]["fraction"] == 0.8 and shown["progress"]["message"] == "step 8"
    # Over 64 KiB: not sent, said in the attempt's log; the task is not failed for it.
    assert "CAIRN_CHECKPOINT_OUT: larger than 65536 bytes: ignored" in big_log
    stored = db.execute(
        "SELECT count(*) FROM core.task_progress WHERE task_id = %s AND checkpoint IS NOT NULL",
        (big["id"],),
    ).fetchone()
    assert stored == (0,)


AGENT_DIES = r"""
if [ -n "$CAIRN_CHECKPOINT" ]; then cp "$CAIRN_CHECKPOINT" @SHARED@/got; exit 0; fi
printf 'from-w1' > "$CAIRN_CHECKPOINT_OUT.tmp"
mv "$CAIRN_CHECKPOINT_OUT.tmp" "$CAIRN_CHECKPOINT_OUT"
sleep 60
"""


def test_a_checkpoint_outlives_a_killed_agent_and_reaches_the_attempt_elsewhere(
    core: Core, tmp_path: Path
) -> None:
    shared = shared_dir()
    fast = {"CAIRN_WORKER_PROGRESS_POLL_S": "0.1", "CAIRN_WORKER_PROGRESS_INTERVAL_S": "0.2"}
    first = spawn_worker(core, tmp_path / "w1", "w1", **fast)
    second: subprocess.Popen[bytes] | None = None
    try:
        with core.client() as alice:
            body = shell_spec(
                AGENT_DIES.replace("@SHARED@", str(shared)),
                retry={"max_attempts": 3, "base_s": 0.1, "jitter": False},
            )
            task = alice.post("/v1/tasks", json=body).json()

            def shown() -> dict:
                return alice.get(f"/v1/tasks/{task['id']}").json()

            wait_for(lambda: (shown()["progress"] or {}).get("checkpoint_bytes") == 7)
            stop_process(first, signal.SIGKILL)  # the agent; its sidecar kills the attempt
            second = spawn_worker(core, tmp_path / "w2", "w2", **fast)
            wait_for(lambda: shown()["state"] == "succeeded", timeout=60)
            attempts = alice.get(f"/v1/tasks/{task['id']}/attempts").json()["items"]
    finally:
        stop_process(first, signal.SIGKILL)
        if second is not None:
            stop_process(second, signal.SIGKILL)
    assert (shared / "got").read_bytes() == b"from-w1"
    assert [a["outcome"] for a in attempts][-1] == "succeeded" and len(attempts) == 2
    assert attempts[0]["worker_id"] != attempts[1]["worker_id"]


class CountingProxy:
    """Core behind a proxy that counts the requests a worker sends, by kind."""

    def __init__(self, core: Core) -> None:
        self.seen: Counter[str] = Counter()
        clients: list[httpx.AsyncClient] = []

        async def app(scope, receive, send):  # type: ignore[no-untyped-def]
            if scope["type"] == "lifespan":  # the client lives and dies on the server's loop
                while True:
                    message = await receive()
                    if message["type"] == "lifespan.startup":
                        clients.append(httpx.AsyncClient(base_url=core.url, timeout=60))
                        await send({"type": "lifespan.startup.complete"})
                    elif message["type"] == "lifespan.shutdown":
                        await clients[0].aclose()
                        await send({"type": "lifespan.shutdown.complete"})
                        return
            upstream = clients[0]
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            path = scope["path"]
            self.seen[path.rsplit("/", 1)[-1]] += 1
            headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k != b"host"]
            query = scope["query_string"].decode()
            answer = await upstream.request(
                scope["method"],
                path + (f"?{query}" if query else ""),
                content=body,
                headers=headers,
            )
            out = [
                (k.encode(), v.encode())
                for k, v in answer.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")
            ]
            out.append((b"content-length", str(len(answer.content)).encode()))
            await send(
                {"type": "http.response.start", "status": answer.status_code, "headers": out}
            )
            await send({"type": "http.response.body", "body": answer.content})

        port = free_port()
        self.server, self.thread = serve_in_thread(app, port, "proxy")
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def test_a_flood_of_progress_writes_costs_core_one_turn_per_interval(
    core: Core, tmp_path: Path
) -> None:
    proxy = CountingProxy(core)
    # One slot: while the attempt runs the agent claims nothing, so every turn it sends
    # is its report or carries progress.
    proxied = Core(proxy.url, core.db_url, core.server, core.thread, core.tokens)
    agent = spawn_worker(
        proxied,
        tmp_path / "worker",
        "flood-worker",
        CAIRN_WORKER_SLOTS="1",
        CAIRN_WORKER_PROGRESS_POLL_S="0.05",
        CAIRN_WORKER_PROGRESS_INTERVAL_S="0.5",
    )
    flood = (
        "i=0; while [ $i -lt 1000 ]; do i=$((i+1)); "
        'printf \'{"fraction": 0.%04d}\' $((i * 9)) > "$CAIRN_PROGRESS.t"; '
        'mv "$CAIRN_PROGRESS.t" "$CAIRN_PROGRESS"; done; sleep 1; echo done'
    )
    try:
        with core.client() as alice:
            task = alice.post("/v1/tasks", json=shell_spec(flood)).json()
            wait_for(lambda: proxy.seen["turn"] > 0)  # it claimed
            claimed_by = proxy.seen["turn"]
            wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "succeeded")
            shown = alice.get(f"/v1/tasks/{task['id']}").json()
            [attempt] = alice.get(f"/v1/tasks/{task['id']}/attempts").json()["items"]
    finally:
        stop_process(agent, signal.SIGKILL)
        proxy.stop()
    ran_s = (
        datetime.fromisoformat(attempt["ended_at"]) - datetime.fromisoformat(attempt["started_at"])
    ).total_seconds()
    turns = proxy.seen["turn"] - claimed_by
    # 1,000 writes (an exec of mv each: the attempt runs ~3 s, six intervals; 3,000 took
    # 10 s and proved no more, and a turn per write seen fails it with 33 turns): at most
    # one turn of its own per 0.5 s while it ran (plus its report and the claims after
    # it: a claim waits about a second at core with these heartbeats), and the last value
    # reached core.
    assert shown["progress"]["fraction"] == 0.9
    assert 1 <= turns <= ran_s / 0.5 + 10, (turns, ran_s, proxy.seen)
