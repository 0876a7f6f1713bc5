"""Egress per queue (issue 32, part 3; docs/security.md "Egress") enforced by a real agent
running as root: tasks of three queues try to connect to three listeners this test
starts on loopback. One stands for a blocked destination (the database's port, listed in
``CAIRN_WORKER_EGRESS_BLOCK``), one is on the ``allow`` queue's list, one is any other
service. What each connection did is the task's outputs, read from the database. The
agent's nftables table is its own (named by its home and pid) and is gone afterwards."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.worker import firewall
from tests.support import Core, shell_spec, spawn_worker, stop_process, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the agent must run as root to isolate"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) is not installed"),
]

PYTHON = Path(os.path.realpath("/usr/bin/python3"))
PROBE = """
import errno, json, os, socket
found = {"interfaces": sorted(name for _, name in socket.if_nameindex())}
for name, port in (("blocked", %d), ("listed", %d), ("other", %d)):
    with socket.socket() as sock:
        sock.settimeout(3)
        try:
            sock.connect(("127.0.0.1", port))
            found[name] = "connected"
        except OSError as exc:
            found[name] = errno.errorcode.get(exc.errno, "timeout")
with open(os.environ["CAIRN_OUTPUTS"], "w") as out:
    json.dump(found, out)
"""


@pytest.fixture
def listeners() -> Iterator[list[int]]:
    socks = []
    for _ in range(3):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        socks.append(sock)
    yield [s.getsockname()[1] for s in socks]
    for sock in socks:
        sock.close()


def _tables() -> set[str]:
    return set(firewall.tables())


def _probe(core: Core, queue: str, ports: list[int]) -> int:
    digest = hashlib.sha256(PYTHON.read_bytes()).hexdigest()
    body = shell_spec("", queue=queue, name=f"probe-{queue}")
    body["artifact"] = {"uri": f"file://{PYTHON}", "sha256": digest}
    body["args"] = ["-c", PROBE % tuple(ports)]
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def test_none_default_and_allow_are_enforced_and_the_agents_table_is_removed(
    core: Core, db, tmp_path: Path, listeners: list[int]
) -> None:
    blocked, listed, _other = listeners
    with core.client("root", "admin") as admin:
        allow = {"mode": "allow", "allow": [{"cidr": "127.0.0.1/32", "port": listed}]}
        for queue, egress in (("sealed", {"mode": "none"}), ("listed", allow)):
            answer = admin.patch(f"/v1/queues/{queue}", json={"egress": egress})
            assert answer.status_code == 200, answer.text
    ids = {queue: _probe(core, queue, listeners) for queue in ("default", "sealed", "listed")}
    home = tmp_path / "agent"
    # A table an earlier agent of this home left (it died, and so did its sidecar).
    leftover = firewall.table_name(home, 999_999_999)
    subprocess.run(["nft", "add", "table", "inet", leftover], check=True)
    try:
        agent = spawn_worker(
            core,
            home,
            "egress-w",
            CAIRN_WORKER_QUEUES="default,sealed,listed",
            CAIRN_WORKER_EGRESS_BLOCK=f"127.0.0.1/32:{blocked}",
        )
        table = firewall.table_name(home, agent.pid)
        try:
            wait_for(lambda: table in _tables() and leftover not in _tables(), timeout=30)
            # Other processes of the host are not touched: this one reaches the port.
            socket.create_connection(("127.0.0.1", blocked), timeout=3).close()
            done = f"SELECT count(*) FROM core.tasks WHERE state = 'succeeded' AND id IN {tuple(ids.values())}"
            wait_for(lambda: db.execute(done).fetchone()[0] == 3, timeout=30, interval=0.1)
            found = {
                queue: db.execute(
                    "SELECT outputs FROM core.attempts WHERE task_id = %s", (task,)
                ).fetchone()[0]
                for queue, task in ids.items()
            }
            # The allow attempt's chain is gone once its uid is handed back.
            wait_for(lambda: "allow_" not in _listing(table), timeout=10)
        finally:
            assert stop_process(agent, signal.SIGTERM) == 0
    finally:
        firewall.delete(leftover)
    assert not {t for t in _tables() if t.startswith(table.rpartition("_")[0])}
    # host (the default): all but the blocked destination, refused at once.
    assert found["default"]["blocked"] == "ECONNREFUSED"
    assert found["default"]["listed"] == found["default"]["other"] == "connected"
    # none: a namespace of its own, loopback only, where nothing of the host listens.
    assert found["sealed"] == {
        "interfaces": ["lo"],
        "blocked": "ECONNREFUSED",
        "listed": "ECONNREFUSED",
        "other": "ECONNREFUSED",
    }
    # allow: only what is listed; the blocklist wins over the list.
    assert found["listed"]["listed"] == "connected"
    assert found["listed"]["blocked"] == found["listed"]["other"] == "ECONNREFUSED"


def _listing(table: str) -> str:
    done = subprocess.run(
        ["nft", "list", "table", "inet", table], capture_output=True, text=True, check=False
    )
    return done.stdout


def test_the_table_of_an_agent_that_was_killed_is_removed_by_its_sidecar(
    core: Core, tmp_path: Path
) -> None:
    home = tmp_path / "agent"
    agent = spawn_worker(core, home, "egress-k")
    table = firewall.table_name(home, agent.pid)
    try:
        wait_for(lambda: table in _tables() and _sidecar_of(agent.pid), timeout=30)
    finally:
        stop_process(agent, signal.SIGKILL)
    try:
        wait_for(lambda: table not in _tables(), timeout=10)
    finally:
        firewall.delete(table)


def _sidecar_of(pid: int) -> bool:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        try:
            if b"services.worker.sidecar" in Path(f"/proc/{child}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False
