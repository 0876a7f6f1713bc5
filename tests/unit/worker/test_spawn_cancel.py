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
from services.worker.artifacts import ArtifactCache
from tests.support.procs import child_states, of_uid
from tests.unit.worker.test_source_unanswered import _binary, _log
from tests.unit.worker.test_spawn_path import _assignment, _attempt, _gone, _host
from tests.unit.worker.test_spawn_serving import _turns, _unread

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attempts run as uids of their own")

UID = 29996


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
    nothing of it is left: no process of that uid, no child of the helper but its
    checker, no record or descriptor of it in the agent."""
    binary = _binary(root)
    sleeper = spawner.Launch("/bin/sleep", ["sleep", "30"], {}, "/", uid=UID, gid=UID)

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        await helper.ready()
        before, resident = _fds(), len(child_states(helper.pid))  # its source checker
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
            assert of_uid(UID) == [] and len(child_states(helper.pid)) == resident
            assert not helper._exits and not helper._abandoned and not helper._replies
            # Its helper goes on: the next start runs.
            _, exited = await helper.spawn(spawner.Launch("/bin/true", ["true"], {}, "/"), log)
            assert (await exited)[0] == 0
        finally:
            os.close(log)
            helper.close()
        assert _fds() <= before

    asyncio.run(scenario())


def test_a_slot_and_uid_are_handed_back_only_after_the_cancelled_start_ended(root: Path) -> None:
    """One pooled cgroup v1 slot: an attempt's launch is cancelled after its request was
    sent, its helper not yet having read it, and its release begun at once (as the
    agent's ``_prepared`` does). Until the start's exit record the slot stays out of the
    pool and the uid held; then the process it started (writing its pid, then sleeping)
    is gone, the slot holds its helper alone, and the next attempt gets that slot, runs
    alone in it (its helper's counters final) and succeeds. No descriptor is left."""
    host = _host(root, worker_slots=1)
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")
    marks = root / "marks"
    marks.mkdir(mode=0o777)
    marks.chmod(0o777)
    cache = ArtifactCache(host.settings.home / "artifacts")

    async def scenario() -> None:
        try:
            warm, _ = await _attempt(host, 1, "true")  # its slot and helper made
            await host.release(warm)
            before = _fds()
            script = f"echo $$ > {marks}/pid; exec sleep 30"
            prepared = await host.prepare(_assignment(2, script), cache)
            slot = prepared.slot
            assert slot is not None and prepared.identity is not None
            uid, helper = prepared.identity.uid, slot.helper
            releases: list[asyncio.Task[None]] = []

            async def attempt() -> None:
                try:
                    await host.launch(prepared, cache)
                finally:
                    releases.append(asyncio.create_task(host.release(prepared)))

            with _unread(helper):
                launch = asyncio.create_task(attempt())
                await _turns(3)
                assert helper._replies and not helper._backlog  # sent, unanswered
                launch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await launch
                await asyncio.sleep(0.2)
                [release] = releases
                assert not release.done(), "released before its start was settled"
                assert slot not in host.slots._free and host.pool is not None
                assert uid in host.pool._held
            await asyncio.wait_for(release, 10)
            stray = marks / "pid"
            if stray.exists():  # it ran as far as its first line before the kill
                assert _gone(int(stray.read_text()))
            assert of_uid(uid) == []
            assert slot in host.slots._free and uid not in host.pool._held
            procs = (slot.group.folders["memory"] / "cgroup.procs").read_text().split()
            assert procs == [str(helper.pid)]
            nxt = await host.prepare(_assignment(3, "echo alone"), cache)
            handle = await host.launch(nxt, cache)
            result = await handle.wait()
            handle.log.close()
            assert nxt.slot is slot and result.outcome == "succeeded"
            counters = handle._exit.result().counters  # its helper's, at its exit record
            assert counters is not None and counters.alone and counters.final, counters
            await host.release(nxt)
            assert _fds() <= before
        finally:
            await host.close()

    asyncio.run(scenario())
