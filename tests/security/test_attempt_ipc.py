"""System V IPC an attempt makes (shared memory, message queues, semaphores), against a
real root agent and a real core: none of it outlives the attempt, neither its memory
nor what it holds for the next attempt given the same uid."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.security.test_hostile_tasks import (  # noqa: F401 - fixtures
    Agent,
    agents,
    core,
    run,
    shell,
)

KEY = 0x43414952  # "CAIR"
SIZE = 32 << 20

#: makes a segment under KEY (IPC_CREAT, 0600), touches its 32 MB, writes a secret, and
#: leaves without removing it, as a program that crashed would; and a message queue
WRITE = f"""python3 - <<'PY'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
shmid = libc.shmget({KEY}, {SIZE}, 0o1600)
addr = libc.shmat(shmid, None, 0)
assert shmid >= 0 and addr not in (None, 2**64 - 1), ctypes.get_errno()
ctypes.memset(addr, 0x41, {SIZE})
ctypes.memmove(addr, b"alice-secret", 12)
queue = libc.msgget({KEY}, 0o1600)
print("segment", shmid, "queue", queue, "uid", os.getuid())
PY"""

#: the next attempt, of the same uid: what it finds under KEY
READ = f"""python3 - <<'PY'
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
shmid = libc.shmget({KEY}, 0, 0)
if shmid < 0:
    print("no segment, errno", ctypes.get_errno())
else:
    addr = libc.shmat(shmid, None, 0)
    print("found", ctypes.string_at(addr, 12).decode())
print("queue", libc.msgget({KEY}, 0))
PY"""


def _host_ipc(kind: str) -> set[str]:
    """The ids of the host's IPC namespace's objects of ``kind`` (shm, msg)."""
    lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
    return {line.split()[1] for line in lines}


def test_sysv_ipc_of_an_attempt_is_gone_with_it(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
):
    """Attempts shared the host's IPC namespace: a segment an attempt left stayed, with
    its pages (32 MB here, any size up to its memory limit each time, charged to the
    pooled slot's cgroup the next attempt there is given), and the next attempt given
    the same uid attached it and read what the last one held there. Each attempt has
    an IPC namespace of its own now, which ends with its last process."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    uid = 20000 + 1000 * (index % 9) + 998  # one uid: the reader is given the writer's
    agents.append(Agent(core, tmp_path / "w", CAIRN_WORKER_UIDS=f"{uid}-{uid}"))
    memory = {"cpu": 1, "memory_mb": 256}
    writer = run(core, shell(WRITE, resources=memory))
    made = re.search(r"segment (\d+) queue (\d+) uid (\d+)", writer["log"])
    try:
        assert writer["state"] == "succeeded" and made, writer["log"]
        reader = run(core, shell(READ, resources=memory))
        assert reader["state"] == "succeeded", reader["log"]
        assert int(made[3]) == uid and "found" not in reader["log"], reader["log"]
        assert "no segment, errno 2" in reader["log"] and "queue -1" in reader["log"]
        assert made[1] not in _host_ipc("shm") and made[2] not in _host_ipc("msg")
    finally:
        # Without the fix they are in the host's namespace: this test's own, removed.
        if made and made[1] in _host_ipc("shm"):
            subprocess.run(["ipcrm", "-m", made[1]], check=False)
        if made and made[2] in _host_ipc("msg"):
            subprocess.run(["ipcrm", "-q", made[2]], check=False)
