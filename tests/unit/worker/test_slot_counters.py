"""A pooled slot's counters kept by its spawn helper (``spawner.Counters``): it resets
them before each start and reads them when it reaps the attempt, and the agent takes them
only when nothing of the attempt was left in the slot; otherwise it kills what is left and
reads the cgroup's files itself."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from services.worker.cgroups import AttemptCgroup
from services.worker.executor import AttemptResult
from tests.unit.worker.test_spawn_path import _attempt, _gone, _host

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="attempts run as uids of their own as root"),
]

HOG = "python3 -c \"b = bytearray(40 * 2**20); b[::4096] = b'x' * len(b[::4096])\""


def test_the_helpers_figures_stand_unless_something_of_the_attempt_is_left(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = _host(root)
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")
    reads: list[str] = []
    for name in ("peak_memory_mb", "cpu_seconds", "oom_kills", "kill_all"):
        original = getattr(AttemptCgroup, name)

        def counted(self: AttemptCgroup, *args: Any, _name: str = name, _f: Any = original) -> Any:
            reads.append(_name)
            return _f(self, *args)

        monkeypatch.setattr(AttemptCgroup, name, counted)

    async def scenario() -> tuple[AttemptResult, list[str], AttemptResult, list[str], int]:
        try:
            first, one = await _attempt(host, 1, f"{HOG}; echo done")
            assert first.slot is not None and first.slot.helper.counts
            seen_one = list(reads)
            await host.release(first)
            reads.clear()
            script = f"{HOG}; setsid sleep 300 & echo $! > $HOME/pid"
            second, two = await _attempt(host, 2, script)
            stray = int((second.folders.view / "pid").read_text())
            seen_two = list(reads)
            await host.release(second)
            return one, seen_one, two, seen_two, stray
        finally:
            await host.close()

    one, seen_one, two, seen_two, stray = asyncio.run(scenario())
    for result in (one, two):
        assert result.outcome == "succeeded", result
        assert result.peak_memory_mb is not None and result.peak_memory_mb >= 40, result
        assert result.cpu_seconds is not None and result.cpu_seconds > 0, result
    # Nothing of the first was left: its figures are the helper's, no cgroup file read
    # (the slot's release finds it settled: ``kill_all`` returns at once).
    assert not {"peak_memory_mb", "cpu_seconds", "oom_kills"} & set(seen_one), seen_one
    # The second left a process outside its group: killed, and the files read.
    assert {"peak_memory_mb", "cpu_seconds", "oom_kills", "kill_all"} <= set(seen_two), seen_two
    assert _gone(stray)
