"""The benchmarks' floor (``bench/floor.c`` through ``bench/floor.py``): it compiles, spawns
the program as many times as asked, reports CPU and wall time, names what it skipped, and
the ratio the benchmarks print is Cairn's figure over it."""

from __future__ import annotations

import os
import shutil
import subprocess
from types import ModuleType

import pytest

from tests.support.bench import load


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    return load("floor")


@pytest.mark.skipif(shutil.which("cc") is None, reason="the floor is compiled with cc")
def test_the_floor_spawns_the_program_and_reports_its_cost(floor: ModuleType) -> None:
    with floor.Runner() as runner:
        one = runner.run(["/bin/true"], 5)
        two = runner.run(["/bin/bash", "-c", "true"], 4, jobs=2)
    assert (one.spawns, len(one.walls_us), two.spawns, two.walls_us) == (5, 5, 4, [])
    assert one.cpu_us > 0 and one.wall_us >= sum(one.walls_us)
    assert one.wall_p50_ms is not None and two.wall_p50_ms is None
    if os.geteuid() != 0:
        assert "uid (not root)" in one.skipped
    elif runner.procs:
        assert one.skipped == ""


@pytest.mark.skipif(shutil.which("cc") is None, reason="the floor is compiled with cc")
def test_the_sandboxed_floor_gives_its_spawns_the_rest_of_an_attempts_sandbox(
    floor: ModuleType,
) -> None:
    """``sandbox``: each spawn, seen from inside its program, has each part of the sandbox
    the floor's description names, and the bare spawn lacks each part it cannot inherit
    (each check on its own). As root it empties uid 65534's keyrings, as the bare floor's
    spawns run as that uid anyway."""
    checks = [
        "grep -q '^NoNewPrivs:[[:space:]]*1$' /proc/self/status",
        '[ "$(cut -d\' \' -f5 /proc/$$/stat)" = "$$" ]',  # a process group of its own
        '[ "$(umask)" = 0077 ]',
        '[ "$(ulimit -c)" = 0 ]',
        "grep -q '^SigBlk:[[:space:]]*0*$' /proc/self/status",
        "[ ! -e /proc/$$/fd/3 ]",
    ]
    inherited = {2, 3, 4, 5}  # what a bare spawn may have from the test's own process
    with floor.Runner() as runner:
        if os.geteuid() == 0:
            home, program = runner._sandbox / "home", runner._sandbox / "program"
            ipc, shm = os.readlink("/proc/self/ns/ipc"), os.stat("/dev/shm").st_dev
            checks += [
                '[ "$(id -u)" = 65534 ]',
                f'[ "$(readlink /proc/self/ns/ipc)" != "{ipc}" ]',
                f'[ "$(pwd)" = {home} ]',
                f"grep -q ' {home} tmpfs ' /proc/self/mounts",
                f"grep -q ' {program} ' /proc/self/mounts",
                f'[ "$(stat -c %d /dev/shm)" != {shm} ]',
                ": > tmp/seen && [ -e /var/tmp/seen ]",  # the home's tmp on /var/tmp
            ]
            inherited |= {6, len(checks) - 1}  # the uid; a file the bare one would leave
        for i, check in enumerate(checks):
            got = runner.run(["/bin/sh", "-c", check], 2, sandbox=True)
            assert got.spawns == 2 and 0 < got.child_cpu_us <= got.cpu_us, check
            if i not in inherited:
                with pytest.raises(subprocess.CalledProcessError, match="exit status 3"):
                    runner.run(["/bin/sh", "-c", check], 1)
    if os.geteuid() == 0 and runner.procs:
        assert got.skipped == ""
    elif os.geteuid() != 0:
        assert "IPC namespace and keyrings (not root)" in got.skipped


@pytest.mark.skipif(shutil.which("cc") is None, reason="the floor is compiled with cc")
def test_a_failing_program_is_an_error_not_a_floor(floor: ModuleType) -> None:
    with (
        floor.Runner() as runner,
        pytest.raises(subprocess.CalledProcessError, match="exit status 3"),
    ):
        runner.run(["/bin/false"], 2)


def test_runs_add_up_and_ratios_read_cairn_over_floor(floor: ModuleType) -> None:
    total = floor.Floor()
    total.add(
        floor.parse("spawns=2\njobs=1\ncpu_us=1000\nwall_us=3000\nskipped=\nwalls_us=1400,1600\n")
    )
    total.add(
        floor.parse(
            "spawns=2\njobs=2\ncpu_us=3000\nwall_us=1000\nskipped=cgroup slot (no cgroup v1)\n"
        )
    )
    assert (total.cpu_ms, total.wall_ms, total.wall_p50_ms) == (1.0, 1.0, 1.5)
    assert total.skipped == "cgroup slot (no cgroup v1)"
    assert "skipped: cgroup slot" in floor.describe(total)
    assert (floor.ratio(3.0, total.cpu_ms), floor.ratio(1.0, 0.0)) == ("3.00x", "n/a")
