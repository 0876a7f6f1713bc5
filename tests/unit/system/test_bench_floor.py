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
    """``sandbox``: each spawn as unprivileged, with no_new_privs and umask 077, and as
    root also in its own IPC namespace, in a tmpfs home, with a tmpfs /dev/shm and /tmp
    bound onto /var/tmp (a file made in one is in the other); the bare spawn has none of
    it (its program, the same checks, fails)."""
    ipc = os.readlink("/proc/self/ns/ipc")
    checks = [
        "grep -q '^NoNewPrivs:[[:space:]]*1$' /proc/self/status",
        '[ "$(umask)" = 0077 ]',
    ]
    if os.geteuid() == 0:
        checks += [
            '[ "$(id -u)" = 65534 ]',
            f'[ "$(readlink /proc/self/ns/ipc)" != "{ipc}" ]',
            '[ "$(pwd)" = /tmp/home ]',
            "grep -q ' /dev/shm tmpfs ' /proc/self/mounts",
            "grep -q ' /tmp/home tmpfs ' /proc/self/mounts",
            ": > /tmp/seen && [ -e /var/tmp/seen ]",
        ]
    program = ["/bin/sh", "-c", " && ".join(checks)]
    with floor.Runner() as runner:
        got = runner.run(program, 3, sandbox=True)
        with pytest.raises(subprocess.CalledProcessError, match="exit status 3"):
            runner.run(program, 1)
    assert got.spawns == 3
    if os.geteuid() == 0 and runner.procs:
        assert got.skipped == ""
    assert "an IPC namespace" in floor.describe(got, sandbox=True)


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
