"""The kernel's keyrings (``keyctl``, ``add_key``), against a real root agent and a real
core: a key one attempt stores is found by no other attempt, of another uid through the
session keyring they would share, nor of its own uid through that uid's keyrings."""

from __future__ import annotations

import os
import platform
import re
import subprocess

import pytest

from tests.security.test_hostile_tasks import (  # noqa: F401 - fixtures
    Agent,
    agents,
    core,
    run,
    shell,
)

#: keyctl(2) and add_key(2) on x86-64, and the keyrings a process names by number
PROGRAM = """python3 - {mode} <<'PY'
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
SESSION, USER = -3, -4

def keyctl(*args):
    return libc.syscall(250, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])

# "own" and "read": a session keyring of the task's own first (as "keyctl session" makes
# one): the one it inherits is sealed (seen, not searched nor written), and only a
# keyring linked from one's own session keyring is one's to write ("own" writes, then
# reads back)
own = sys.argv[1] in ("own", "read")
if own:
    print("joined", keyctl(1, None), ctypes.get_errno())
rings = {{"session": SESSION, "user": USER, "persistent": keyctl(22, -1, SESSION if own else USER)}}
steps = {{"write": ["write"], "read": ["read"], "own": ["write", "read"]}}[sys.argv[1]]
for step in steps:
    for name, ring in rings.items():
        if step == "write":
            secret = b"secret-of-" + name.encode()
            made = libc.syscall(248, b"user", b"cairn-" + name.encode(), secret,
                                ctypes.c_long(len(secret)), ctypes.c_long(ring))
            print("wrote", name, made, ctypes.get_errno(), "uid", os.getuid())
        else:
            key = keyctl(10, ring, b"user", b"cairn-" + name.encode(), 0)
            data = ctypes.create_string_buffer(64)
            got = keyctl(11, key, data, 64) if key > 0 else -1
            print("read", name, key, got, data.value.decode() or "nothing", "uid", os.getuid())
PY"""


#: fills its uid's key quota (200 keys, 20,000 bytes) in its persistent keyring
FILL = """python3 - <<'PY'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(250, ctypes.c_long(1), None)  # a session keyring of its own to link it from
ring = libc.syscall(250, ctypes.c_long(22), ctypes.c_long(-1), ctypes.c_long(-3))
made = 0
while libc.syscall(248, b"user", b"k%d" % made, b"x" * 90, ctypes.c_long(90), ctypes.c_long(ring)) > 0:
    made += 1
print("filled", made, "errno", ctypes.get_errno(), "uid", os.getuid())
PY"""

#: what the test leaves in its uids' keyrings, removed as each uid (without the fix
#: they outlive the test: the persistent keyring for days)
CLEAR = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
persistent = libc.syscall(250, ctypes.c_long(22), ctypes.c_long(-1), ctypes.c_long(-3))
for ring in (-4, -5, persistent):
    if ring != -1:
        libc.syscall(250, ctypes.c_long(7), ctypes.c_long(ring))
"""


def test_a_key_one_attempt_stores_is_found_by_no_other(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
):
    """Every attempt of an agent inherited its session keyring (through the spawn
    helper; under systemd a service has one of its own, KeyringMode=private), and
    possessing a keyring grants its possessor's rights whatever the uid: an attempt
    stored a key there and an attempt of another uid read it. A uid's user and
    persistent keyrings outlive its processes: the next attempt given the uid read what
    the last one left there. Each spawn helper's attempts inherit a session keyring the
    helper sealed now (seen, not written), and find their uid's keyrings emptied; a task
    that wants a session keyring makes its own."""
    if platform.machine() != "x86_64":
        pytest.skip("the tasks call keyctl(2) by its x86-64 number")
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = 20000 + 1000 * (index % 9) + 995  # two uids, handed out in turn
    uids = f"{first}-{first + 1}"
    agents.append(Agent(core, tmp_path / "w", session_keyring=True, CAIRN_WORKER_UIDS=uids))
    try:
        writer = run(core, shell(PROGRAM.format(mode="own")))
        log = writer["log"]
        assert writer["state"] == "succeeded", log
        for ring in ("session", "user", "persistent"):
            assert re.search(rf"wrote {ring} \d+ ", log), log
            # Found again (the user keyring's key is the owner's to see, not to read:
            # it is not linked from the session keyring).
            assert re.search(rf"read {ring} \d+ ", log), log
        for ring in ("session", "persistent"):
            assert re.search(rf"read {ring} \d+ \d+ secret-of-{ring} ", log), log
        [uid] = set(re.findall(r"uid (\d+)", writer["log"]))
        # The least recently used uid first (another uid), then the writer's again.
        readers = [run(core, shell(PROGRAM.format(mode="read"))) for _ in range(2)]
        seen = [set(re.findall(r"uid (\d+)", r["log"])) for r in readers]
        assert seen[0] != {uid} and seen[1] == {uid}, seen
        for reader in readers:
            assert reader["state"] == "succeeded", reader["log"]
            for ring in ("session", "user", "persistent"):  # nothing found, let alone read
                assert f"read {ring} -1 -1 nothing" in reader["log"], reader["log"]
        # The session keyring every attempt of a spawn helper inherits is sealed: seen,
        # not written (EACCES), so there is nothing in it to share; nor is the uid's
        # persistent keyring written through a keyring the task does not possess.
        sealed = run(core, shell(PROGRAM.format(mode="write")))
        assert sealed["state"] == "succeeded", sealed["log"]
        assert re.search(r"wrote session -1 13 ", sealed["log"]), sealed["log"]
        assert re.search(r"wrote user \d+ ", sealed["log"]), sealed["log"]
        assert re.search(r"wrote persistent -1 13 ", sealed["log"]), sealed["log"]
        # An attempt that fills its uid's key quota keeps no later one of the uid from
        # starting (the session keyring it inherits is root's; the uid's are emptied).
        full = run(core, shell(FILL))
        assert full["state"] == "succeeded" and "errno 122" in full["log"], full["log"]
        [filled] = set(re.findall(r"uid (\d+)", full["log"]))
        after = [run(core, shell(PROGRAM.format(mode="own"))) for _ in range(2)]
        assert any(f"uid {filled}" in a["log"] for a in after), [a["log"] for a in after]
        assert all(a["state"] == "succeeded" for a in after), [a["log"] for a in after]
    finally:
        for each in (first, first + 1):
            subprocess.run(
                [
                    "setpriv",
                    f"--reuid={each}",
                    f"--regid={each}",
                    "--clear-groups",
                    "/usr/bin/python3",
                    "-c",
                    CLEAR,
                ],
                check=False,
                cwd="/",
            )
