"""The spawn helper's ``file://`` source check against a real FUSE mount whose server
never answers (``tests.support.fuse``), as root: the check gives up after its time limit
(ETIMEDOUT at the source step), a second check of the same path fails at once while the
first checker still hangs (EBUSY), the helper goes on starting other attempts meanwhile,
and it reaps the checker once the mount lets it go."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from pathlib import Path

import pytest

from services.worker import spawner
from tests.support.fuse import unanswered_fuse

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="root mounts FUSE itself"
)

LIMIT_S = 0.3


def _check(source: Path) -> spawner.Launch:
    return spawner.Launch(
        "/bin/true",
        ["true"],
        {},
        "/",
        uid=os.getuid(),
        gid=os.getgid(),
        source=str(source),
        source_stamp=(0, 0, 0, 0, 0),
        source_types="ef53",
        source_timeout_s=LIMIT_S,
    )


def _children(pid: int) -> list[str]:
    """The states of ``pid``'s children (``R``, ``D``, ``Z``...)."""
    states = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()
            if int(fields[1]) == pid:
                states.append(fields[0])
    return states


def test_a_source_that_never_answers_fails_its_start_and_jams_nothing(tmp_path: Path) -> None:
    binary = spawner.build(spawner.default_folders(tmp_path))
    if binary is None:
        pytest.skip("no C compiler for the spawn helper")
    log_path = tmp_path / "log"

    async def spawn(helper: spawner.Helper, launch: spawner.Launch) -> tuple[float, object]:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        began = time.monotonic()
        try:
            _, exited = await asyncio.wait_for(helper.spawn(launch, log), 10)
            return time.monotonic() - began, (await exited)[0]
        except spawner.SpawnFailed as failed:
            return time.monotonic() - began, failed
        finally:
            os.close(log)

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        try:
            with unanswered_fuse(tmp_path / "jammed") as mount:
                source = mount / "bin" / "task"
                took, failed = await spawn(helper, _check(source))
                assert isinstance(failed, spawner.SpawnFailed), failed
                assert failed.step == spawner.SOURCE_STEP and failed.errno == errno.ETIMEDOUT
                assert LIMIT_S <= took < LIMIT_S + 2, took
                # Its checker still hangs (the mount's probe holds the folder's lock, so not
                # even SIGKILL ends it): the same path fails at once, and says why.
                took, busy = await spawn(helper, _check(source))
                assert isinstance(busy, spawner.SpawnFailed), busy
                assert busy.errno == spawner.SOURCE_BUSY and took < LIMIT_S, took
                assert "D" in _children(helper.pid)
                # The helper is not jammed: another attempt starts and ends.
                took, status = await spawn(helper, spawner.Launch("/bin/true", ["true"], {}, "/"))
                assert status == 0 and took < 5, (took, status)
            # The mount gone, its checker ends; the next request reaps it.
            deadline = time.monotonic() + 10
            while "D" in _children(helper.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            took, status = await spawn(helper, spawner.Launch("/bin/true", ["true"], {}, "/"))
            assert status == 0
            assert _children(helper.pid) == [], _children(helper.pid)
        finally:
            helper.close()

    asyncio.run(scenario())
