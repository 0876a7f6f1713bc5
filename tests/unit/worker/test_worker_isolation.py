"""The worker's isolation pieces on their own: environment scrubbing, the token file, the
uid pool, folder removal that never follows links, and (as root) attempt cgroups."""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.worker import hardening
from services.worker.cgroups import Cgroups, cpu_bandwidth
from services.worker.isolation import Identity, IsolationError, Sandbox, UidPool, remove_tree


def test_a_scrubbed_secret_is_gone_from_proc_self_environ() -> None:
    code = (
        "from services.worker import hardening\n"
        "hardening.scrub_environ('CAIRN_TOKEN')\n"
        "import os, sys\n"
        "block = open('/proc/self/environ', 'rb').read()\n"
        "sys.exit(0 if b'hunter2' not in block and b'KEEP=me' in block"
        " and 'CAIRN_TOKEN' not in os.environ else 1)\n"
    )
    env = {**os.environ, "CAIRN_TOKEN": "hunter2", "KEEP": "me"}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


@pytest.mark.parametrize("name", ["CAIRN_DATABASE_URL", "CAIRN_DATABASE_DIRECT_URL"])
def test_a_worker_given_a_database_url_refuses_it_in_production_and_drops_it_otherwise(
    name: str,
) -> None:
    code = (
        "import os, sys, types\n"
        "from services.worker import agent, hardening\n"
        "try:\n"
        "    agent._harden(types.SimpleNamespace(env='production'))\n"
        "    sys.exit(3)\n"
        "except hardening.HardeningError as exc:\n"
        f"    assert '{name}' in str(exc), exc\n"
        "agent._harden(types.SimpleNamespace(env='development'))\n"
        "block = open('/proc/self/environ', 'rb').read()\n"
        f"sys.exit(0 if b'hunter2' not in block and '{name}' not in os.environ else 1)\n"
    )
    env = {**os.environ, name: "postgresql://cairn:hunter2@db/cairn"}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


def test_the_token_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("cairn_secret\n")
    path.chmod(0o644)
    with pytest.raises(hardening.HardeningError, match="mode 0600"):
        hardening.read_token(path)
    path.chmod(0o600)
    assert hardening.read_token(path) == "cairn_secret"


def test_two_pools_on_one_host_never_hand_out_the_same_uid(tmp_path: Path) -> None:
    first, second = UidPool(range(30000, 30004), tmp_path), UidPool(range(30000, 30004), tmp_path)
    taken = [first.take(), second.take(), first.take(), second.take()]
    assert len({i.uid for i in taken}) == 4
    with pytest.raises(IsolationError, match="every uid of 30000-30003 is in use"):
        first.take()
    second.give_back(taken[1])
    assert first.take().uid == taken[1].uid


def test_a_lock_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "locks"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(IsolationError, match="others cannot write"):
        UidPool(range(30000, 30001), folder)


def test_removing_an_attempts_folder_never_follows_its_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    folder = tmp_path / "attempt"
    (folder / "deep").mkdir(parents=True)
    (folder / "deep" / "link").symlink_to(outside)
    (folder / "file-link").symlink_to(outside / "keep")
    (folder / "locked").mkdir(mode=0)
    remove_tree(folder)
    assert not folder.exists() and (outside / "keep").read_text() == "precious"


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are made as root here")
def test_an_attempt_cgroup_limits_measures_and_kills_the_whole_tree() -> None:
    driver, note = Cgroups.detect()
    if driver is None:
        pytest.skip(note)
    group = driver.create(987654, memory_mb=64, cpu=0.5, pids_max=16)
    try:
        wanted = {
            "memory.limit_in_bytes", "cpu.cfs_quota_us", "memory.max", "cpu.max", "pids.max"
        }  # fmt: skip
        files = {
            f.name: f.read_text().strip()
            for d in group.folders.values()
            for f in d.iterdir()
            if f.name in wanted
        }
        if driver.version == "v1":
            assert files["memory.limit_in_bytes"] == str(64 * 2**20)
            assert files["cpu.cfs_quota_us"] == "50000"
        else:
            assert files["memory.max"] == str(64 * 2**20)
            assert files["cpu.max"] == "50000 100000"
        assert files["pids.max"] == "16"

        def join() -> None:
            for procs in group.procs_files:
                Path(procs).write_text(str(os.getpid()))

        # A leader that leaves its process group: killpg would miss the grandchild.
        leader = subprocess.Popen(["/bin/sh", "-c", "setsid sleep 60 & sleep 60"], preexec_fn=join)
        deadline = time.monotonic() + 10
        while len(group.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(group.pids()) == 3
        group.kill_all()
        assert leader.wait(timeout=10) == -9
        assert group.pids() == [] and group.cpu_seconds() is not None
        assert (group.peak_memory_mb() or 0) > 0
    finally:
        assert group.remove()
        driver.close()
    assert not any(folder.exists() for folder in group.folders.values())


def test_cpu_bandwidth_keeps_the_share_and_gives_small_requests_10_ms_periods() -> None:
    assert cpu_bandwidth(0.5) == (50_000, 100_000)
    assert cpu_bandwidth(2.0) == (200_000, 100_000)
    assert cpu_bandwidth(0.01) == (10_000, 1_000_000)
    assert cpu_bandwidth(0.05) == (10_000, 200_000)
    assert cpu_bandwidth(0.001) == (
        1_000,
        1_000_000,
    )  # the kernel's longest period, its least quota
    for cpu in (0.001, 0.003, 0.01, 0.05, 0.1, 0.5, 1.0, 3.7):
        quota, period = cpu_bandwidth(cpu)
        assert 100_000 <= period <= 1_000_000 and quota >= 1000
        assert quota >= 10_000 or period == 1_000_000
        assert abs(quota / period - cpu) <= max(0.001, cpu * 0.01)


@pytest.mark.skipif(os.geteuid() != 0, reason="an IPC namespace needs root")
def test_a_forked_attempt_gets_an_ipc_namespace_of_its_own() -> None:
    """Where the agent forks an attempt itself (no spawn helper), ``Sandbox.ipc`` enters
    a new IPC namespace as the helper does (``tests/security/test_attempt_ipc.py``)."""

    def namespace(sandbox: Sandbox) -> str:
        return subprocess.run(
            ["readlink", "/proc/self/ns/ipc"],
            preexec_fn=sandbox.preexec(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    host = os.readlink("/proc/self/ns/ipc")
    assert namespace(Sandbox()) == host
    assert namespace(Sandbox(ipc=True)) not in ("", host)


KEYS = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[1] == "write":
    print(libc.syscall(248, b"user", b"cairn-unit", b"left", ctypes.c_long(4), ctypes.c_long(-4)))
else:
    print(libc.syscall(250, ctypes.c_long(10), ctypes.c_long(-4), b"user", b"cairn-unit", 0))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to a uid needs root")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="keyctl(2) by its x86-64 number")
def test_a_forked_attempt_finds_its_uids_keyrings_emptied() -> None:
    """Where the agent forks an attempt itself, ``Sandbox.preexec`` empties the uid's
    keyrings as the spawn helper does (``tests/security/test_attempt_keyrings.py``): a
    key the last attempt of the uid left in its user keyring is gone."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    uid = 20000 + 1000 * (index % 9) + 994
    sandbox = Sandbox(identity=Identity(uid, uid))

    def as_attempt(mode: str) -> int:
        done = subprocess.run(
            ["/usr/bin/python3", "-c", KEYS, mode],
            preexec_fn=sandbox.preexec(),
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        )
        return int(done.stdout)

    assert as_attempt("write") > 0
    assert as_attempt("read") == -1


def _refuse_keyctl() -> None:
    """A seccomp filter, as Docker's default profile is for keyctl: EPERM, all else runs."""
    nr, ret, jeq, k = 0x20, 0x06, 0x15, 0x00
    program = [
        (nr, 0, 0, 0),  # A = seccomp_data.nr
        (jeq | k, 0, 1, 250),  # keyctl(2) on x86-64?
        (ret | k, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
        (ret | k, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    ]
    filters = (ctypes.c_ubyte * (8 * len(program)))()
    for i, (code, jt, jf, value) in enumerate(program):
        struct.pack_into("=HBBI", filters, 8 * i, code, jt, jf, value)
    fprog = struct.pack("@HP", len(program), ctypes.addressof(filters))
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(fprog)
    if libc.prctl(22, 2, buffer, 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp")


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to a uid needs root")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="keyctl(2) by its x86-64 number")
def test_a_forked_attempt_starts_where_keyctl_is_refused_to_every_process() -> None:
    """Docker's default seccomp profile refuses keyctl (EPERM) to the whole container:
    there are no keyrings to make the attempt's own, and it starts as before."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    apply = Sandbox(identity=Identity(*(20000 + 1000 * (index % 9) + 994,) * 2)).preexec()

    def refused_then_apply() -> None:
        _refuse_keyctl()
        apply()

    done = subprocess.run(
        ["/usr/bin/python3", "-c", KEYS, "read"],
        preexec_fn=refused_then_apply,
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert done.stdout.strip() == "-1"  # the task itself is refused keyctl too
