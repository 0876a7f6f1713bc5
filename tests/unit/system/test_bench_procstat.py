"""The benchmarks' CPU accounting from ``/proc`` (``bench/procstat.py``): a worker agent's
spawn helpers are found among its children by one walk of ``/proc``, their CPU counted,
and no other child's. A walk per helper had cost the bench 0.29 s of CPU at 64 helpers,
inside the window of the machine's figure (``bench/e2e.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.bench import load

# Spends some CPU, says so, then waits for its stdin to close (a builtin: no child).
_BUSY = "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; echo spent; read line"


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str]]]:
    """Two children of this process that spent CPU: a ``cairn-spawn`` named one (a copy
    of the shell) and another."""
    shell = shutil.which("sh")
    assert shell is not None
    helper_binary = tmp_path / "cairn-spawn-t"
    shutil.copy(shell, helper_binary)
    started = [
        subprocess.Popen(
            [str(binary), "-c", _BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for binary in (helper_binary, Path(shell))
    ]
    try:
        for proc in started:
            assert proc.stdout is not None and proc.stdout.readline() == "spent\n"
        yield started[0], started[1]
    finally:
        for proc in started:
            proc.kill()
            proc.communicate()


def test_a_helpers_cpu_is_counted_and_no_other_childs(
    busy: tuple[subprocess.Popen[str], subprocess.Popen[str]],
) -> None:
    procstat = load("procstat")
    helper, other = busy
    table = procstat.processes()
    assert table[helper.pid] == (os.getpid(), "cairn-spawn-t")
    assert table[other.pid][0] == os.getpid()
    assert {helper.pid, other.pid} <= set(procstat.children(os.getpid()))
    assert set(procstat.children(os.getpid(), table)) == set(procstat.children(os.getpid()))

    counted = procstat.helpers_cpu_s(os.getpid())
    helper_s, other_s = procstat.run_time_s(helper.pid), procstat.run_time_s(other.pid)
    assert helper_s > 0.01 and other_s > 0.01
    # The helper's own CPU, and not the other child's (it is done spending: equal reads).
    assert counted == pytest.approx(helper_s, abs=0.005)


def test_one_walk_of_proc_for_all_helpers(
    busy: tuple[subprocess.Popen[str], subprocess.Popen[str]],
) -> None:
    """``/proc`` is walked once, whatever the number of helpers, not once more for each
    helper's own children."""
    procstat = load("procstat")
    walks = 0
    real = procstat.processes

    def counting() -> dict[int, tuple[int, str]]:
        nonlocal walks
        walks += 1
        return real()

    procstat.processes = counting
    assert procstat.helpers_cpu_s(os.getpid()) > 0
    assert walks == 1
