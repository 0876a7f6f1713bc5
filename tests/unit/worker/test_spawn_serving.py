"""The spawn helper goes on serving whatever its source checks do (real helpers, real
FUSE mounts, as root): a kill of a uid whose start is being checked is answered at once
and that start never runs; checkers that did not answer are let go without waiting for
them to die, and reaped as they end, no request needed."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from services.worker import spawner
from tests.support.fuse import FUSE_TYPE, unanswered_fuse, unread_fuse
from tests.unit.worker.test_source_unanswered import _check, _children

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="root mounts FUSE itself"
)

PLAIN = spawner.Launch("/bin/true", ["true"], {}, "/")


def _binary(root: Path) -> Path:
    binary = spawner.build(spawner.default_folders(root))
    if binary is None:
        pytest.skip("no C compiler for the spawn helper")
    return binary


class _Starts:
    """Starts by one helper, each timed: (seconds, exit status or (step, errno))."""

    def __init__(self, helper: spawner.Helper, root: Path) -> None:
        self.helper = helper
        self.log = root / "log"

    async def __call__(self, launch: spawner.Launch) -> tuple[float, object]:
        log = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        began = time.monotonic()
        try:
            _, exited = await asyncio.wait_for(self.helper.spawn(launch, log), 10)
            return time.monotonic() - began, (await exited)[0]
        except spawner.SpawnFailed as failed:
            return time.monotonic() - began, (failed.step, failed.errno)
        finally:
            os.close(log)


async def _timed(request: Awaitable[Any]) -> float:
    began = time.monotonic()
    await asyncio.wait_for(request, 10)
    return time.monotonic() - began


def test_a_kill_of_a_uid_whose_start_is_checked_is_answered_at_once(root: Path) -> None:
    """The agent kills a uid whose start it gave up on while its source was checked: the
    kill is answered at once and the helper goes on serving; that start never runs (its
    check answers later, it fails with ECANCELED, started by nobody); a start of the same
    uid sent after the kill runs."""
    binary = _binary(root)
    limit_s = 2.0
    held = threading.Event()

    async def scenario(source: Path) -> None:
        helper = spawner.Helper(binary)
        start = _Starts(helper, root)
        info = source.stat()
        stamp = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        launch = dataclasses.replace(
            _check(source),
            source_stamp=stamp,
            source_types=f"{FUSE_TYPE:x}",
            source_timeout_s=limit_s,
        )
        try:
            await helper.ready()
            held.set()  # its open waits, as on a slow file system
            checked = asyncio.create_task(start(launch))
            await asyncio.sleep(0.1)
            kill = await _timed(helper.kill_uid(29992))
            plain = await start(PLAIN)
            other = await _timed(helper.kill_uid(29993))
            assert not checked.done()
            assert max(kill, plain[0], other) < limit_s / 4 and plain[1] == 0, (kill, plain, other)
            held.clear()  # its check answers: the source holds
            took, cancelled = await checked
            assert cancelled == (spawner.SOURCE_STEP, errno.ECANCELED), cancelled
            assert took < limit_s, took
            assert errno.ECANCELED in spawner.SOURCE_UNCHECKED  # handed back, if awaited
            took, status = await start(launch)  # sent after the kill: not cancelled
            assert status == 0, status
        finally:
            held.clear()
            helper.close()

    with unread_fuse(root / "slow", "task", 4096, held) as source:
        asyncio.run(scenario(source))


def test_checkers_that_did_not_answer_are_let_go_without_waiting(root: Path) -> None:
    """8 checks of paths under a mount where not even SIGKILL ends an open (MAX_STUCK in
    spawn.c) time out together: all 8 are answered together (no wait for a checker to
    die between them); once the mount is gone, the checkers are reaped as they end, the
    helper asked nothing."""
    binary = _binary(root)
    limit_s = 1.0

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        start = _Starts(helper, root)
        try:
            await helper.ready()
            with unanswered_fuse(root / "jammed") as mount:
                launches = [
                    dataclasses.replace(_check(mount / f"d{n}" / "task"), source_timeout_s=limit_s)
                    for n in range(8)
                ]

                async def answered(launch: spawner.Launch) -> tuple[object, float]:
                    _, result = await start(launch)
                    return result, time.monotonic()

                results = await asyncio.gather(*(answered(launch) for launch in launches))
                assert {result for result, _ in results} == {(spawner.SOURCE_STEP, errno.ETIMEDOUT)}
                times = [at for _, at in results]
                assert max(times) - min(times) < 0.15, [at - min(times) for at in times]
                assert helper.hung_checkers == 8 and _children(helper.pid).count("D") == 8
            deadline = time.monotonic() + 10
            while _children(helper.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _children(helper.pid) == []  # not even zombies: reaped, nothing asked
            await helper.recount()
            assert helper.hung_checkers == 0
        finally:
            helper.close()

    asyncio.run(scenario())
