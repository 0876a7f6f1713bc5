"""A start sent to the spawn helper whose caller stops waiting (cancelled) before it has
the reply is settled all the same (real helpers, real processes, as root): what it
started is killed as soon as its reply comes, its end is awaited through its exit
record, and what the attempt held (its pooled cgroup v1 slot, its uid, its folders and
log) is handed back only then, the way an attempt that ran is: never while that process
may still be born or run, in a slot or as a uid the next attempt is given."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from services.worker import spawner
from tests.unit.worker.test_source_unanswered import _binary, _children, _log
from tests.unit.worker.test_spawn_serving import _turns, _unread

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attempts run as uids of their own")

UID = 29996


def _of_uid(uid: int) -> list[int]:
    """The processes running as ``uid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            line = next(x for x in status.splitlines() if x.startswith("Uid:"))
            if int(line.split()[1]) == uid:
                found.append(int(entry.name))
    return found


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("when", ["before its reply", "as its reply comes", "after its reply"])
def test_a_start_whose_caller_stopped_waiting_is_killed_and_its_end_awaited(
    root: Path, when: str
) -> None:
    """Cancelled once its request went: while the helper has not read it yet (stopped),
    in the pass of the event loop that reads its reply (before the reply is taken, and
    after, the caller not yet resumed). The process it started (as uid 29996, sleeping
    30 s) is killed, the future given to ``unsettled`` ends with its exit record, and
    nothing of it is left: no process of that uid, no child of the helper but its checker, no record or
    descriptor of it in the agent."""
    binary = _binary(root)
    sleeper = spawner.Launch("/bin/sleep", ["sleep", "30"], {}, "/", uid=UID, gid=UID)

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        await helper.ready()
        before, resident = _fds(), len(_children(helper.pid))  # its source checker
        ends: list[asyncio.Future[None]] = []
        log = _log(root / "log")
        try:
            spawn = asyncio.create_task(helper.spawn_counted(sleeper, log, unsettled=ends.append))
            if when == "before its reply":
                with _unread(helper):
                    await _turns(3)
                    assert helper._replies and not helper._backlog  # sent, unanswered
                    spawn.cancel()
                    await _turns(3)
            else:
                replied = helper._replied

                def hook(*reply: Any) -> None:
                    if when == "as its reply comes":
                        spawn.cancel()
                    replied(*reply)
                    if when == "after its reply":
                        spawn.cancel()

                helper._replied = hook  # type: ignore[method-assign]
            with contextlib.suppress(asyncio.CancelledError):
                await spawn
            assert spawn.cancelled()
            assert len(ends) == 1, "a start sent and given up was not settled"
            await asyncio.wait_for(ends[0], 10)
            assert _of_uid(UID) == [] and len(_children(helper.pid)) == resident
            assert not helper._exits and not helper._abandoned and not helper._replies
            # Its helper goes on: the next start runs.
            _, exited = await helper.spawn(spawner.Launch("/bin/true", ["true"], {}, "/"), log)
            assert (await exited)[0] == 0
        finally:
            os.close(log)
            helper.close()
        assert _fds() <= before

    asyncio.run(scenario())
