"""Opens of a ``file://`` source under a real FUSE mount whose server never answers
(``tests.support.fuse``), as root. The spawn helper's check gives up after its time limit
(ETIMEDOUT at the source step), a second check of the same path fails at once while the
first checker still hangs (EBUSY), the helper goes on starting other attempts meanwhile,
and it reaps the checker once the mount lets it go, and makes a new resident checker.
The agent's own seal of such a source (``ArtifactCache.seal_local``, on its thread that
opens files as attempts) fails the same way and leaves one thread to the open, no more;
so does a source whose file system answers its open and hangs on a read."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import os
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from services.worker import artifacts, spawner
from services.worker.artifacts import ArtifactCache, ArtifactError, Sealed, in_open_thread
from services.worker.isolation import Identity
from tests.support.fuse import unanswered_fuse, unread_fuse
from tests.support.procs import child_states

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="root mounts FUSE itself"
)

LIMIT_S = 0.3


def _check(source: Path, healthy: bool = False) -> spawner.Launch:
    """``/bin/true``, started once ``source`` (opened as uid 29992) is the file of its
    stamp (``healthy``: the one it has now) on a local file system."""
    stamp = (0, 0, 0, 0, 0)
    if healthy:
        info = source.stat()
        stamp = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    return spawner.Launch(
        "/bin/true",
        ["true"],
        {},
        "/",
        uid=29992,
        gid=29992,
        source=str(source),
        source_stamp=stamp,
        source_types=artifacts.LOCAL_FS_TYPES,
        source_timeout_s=LIMIT_S,
    )


def _binary(root: Path) -> Path:
    """The spawn helper built for ``root``'s folders (skipped without a C compiler)."""
    binary = spawner.build(spawner.default_folders(root))
    if binary is None:
        pytest.skip("no C compiler for the spawn helper")
    return binary


def _log(path: Path) -> int:
    """A log for starts to write to (appended to, the agent's way)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


class _Starts:
    """Starts by one helper, each timed: (seconds, exit status or (step, errno))."""

    def __init__(self, helper: spawner.Helper, root: Path) -> None:
        self.helper = helper
        self.log = root / "log"

    async def __call__(self, launch: spawner.Launch) -> tuple[float, object]:
        log = _log(self.log)
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


def test_a_source_that_never_answers_fails_its_start_and_jams_nothing(root: Path) -> None:
    tmp_path = root
    binary = _binary(root)
    log_path = tmp_path / "log"

    async def spawn(helper: spawner.Helper, launch: spawner.Launch) -> tuple[float, object]:
        log = _log(log_path)
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
            # Its resident checker answers the first check, outside any start.
            took, status = await spawn(helper, _check(Path("/bin/true"), healthy=True))
            # (sleeping in its recv, or about to: running)
            assert status == 0 and child_states(helper.pid) in (["S"], ["R"]), child_states(
                helper.pid
            )
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
                assert "D" in child_states(helper.pid) and helper.hung_checkers == 1
                # The helper is not jammed: another attempt starts and ends.
                took, status = await spawn(helper, spawner.Launch("/bin/true", ["true"], {}, "/"))
                assert status == 0 and took < 5, (took, status)
            # The mount gone, its checker ends (a zombie once its exit is done: until then
            # a request finds it still running); the next request reaps it.
            deadline = time.monotonic() + 10
            while set(child_states(helper.pid)) - {"Z"} and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # Its last reply still counts it; asked again (as the agent's pulse asks a
            # helper whose checkers hang), it is reaped and counted out, nothing started.
            assert helper.hung_checkers == 1
            await spawner.recount_hung()
            assert helper.hung_checkers == 0 and child_states(helper.pid) == []
            # Its resident checker hung, and is gone: the next check makes a new one (a
            # helper that joined no cgroup v1 slot), which stays for the checks after it.
            for _ in range(2):
                took, status = await spawn(helper, _check(Path("/bin/true"), healthy=True))
                assert status == 0 and helper.hung_checkers == 0
                assert child_states(helper.pid) in (["S"], ["R"]), child_states(helper.pid)
        finally:
            helper.close()

    asyncio.run(scenario())


def test_a_full_table_of_hung_checkers_blames_no_source(root: Path) -> None:
    """``MAX_STUCK`` checkers of other paths still hang: a check of any path then fails
    with EAGAIN (the helper's fault, ``SOURCE_UNCHECKED``), not EBUSY (that path's)."""
    binary = _binary(root)

    async def spawn(helper: spawner.Helper, launch: spawner.Launch) -> object:
        log = _log(root / "log")
        try:
            _, exited = await asyncio.wait_for(helper.spawn(launch, log), 10)
            return (await exited)[0]
        except spawner.SpawnFailed as failed:
            return failed.step, failed.errno
        finally:
            os.close(log)

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        try:
            with unanswered_fuse(root / "jammed") as mount:
                for n in range(8):  # MAX_STUCK in spawn.c
                    failed = await spawn(helper, _check(mount / f"d{n}" / "task"))
                    assert failed == (spawner.SOURCE_STEP, errno.ETIMEDOUT), (n, failed)
                assert child_states(helper.pid).count("D") == 8, child_states(helper.pid)
                # Its replies say so: the agent's gauge (``spawner.hung_checkers``).
                assert helper.hung_checkers == 8 and spawner.hung_checkers() >= 8
                same = await spawn(helper, _check(mount / "d0" / "task"))
                assert same == (spawner.SOURCE_STEP, spawner.SOURCE_BUSY), same
                for source in (mount / "d8" / "task", Path("/bin/true")):
                    full = await spawn(helper, _check(source, healthy=source.name == "true"))
                    assert full == (spawner.SOURCE_STEP, errno.EAGAIN), (source, full)
                    assert errno.EAGAIN in spawner.SOURCE_UNCHECKED
        finally:
            helper.close()

    asyncio.run(scenario())


def test_a_check_that_hangs_holds_back_no_other_request_of_its_helper(root: Path) -> None:
    """One helper starts every attempt of an agent on cgroup v2 (or without cgroups): while
    a check of one source hangs, it starts other attempts (with another source checked, or
    none), answers a kill and a recount; the start of the hung source still fails with
    ETIMEDOUT after the limit, and another start of that path sent meanwhile waits for it,
    then fails with EBUSY. A kill of that start's uid is answered at once too (that start
    never runs: ``test_spawn_serving``)."""
    binary = _binary(root)
    limit_s = 1.5

    def checked(source: Path, healthy: bool = False) -> spawner.Launch:
        return dataclasses.replace(_check(source, healthy), source_timeout_s=limit_s)

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        spawn = _Starts(helper, root)
        try:
            with unanswered_fuse(root / "jammed") as mount:
                source = mount / "bin" / "task"
                hung = asyncio.create_task(spawn(checked(source)))
                await asyncio.sleep(0.1)  # its check begun
                launch = dataclasses.replace(checked(source), uid=29994, gid=29994)
                same = asyncio.create_task(spawn(launch))
                await asyncio.sleep(0.1)
                plain = await spawn(spawner.Launch("/bin/true", ["true"], {}, "/"))
                other = await spawn(checked(Path("/bin/true"), healthy=True))
                other_kill = await _timed(helper.kill_uid(29993))
                recount = await _timed(helper.recount())
                assert not hung.done() and not same.done()
                for took, status in (plain, other):
                    assert status == 0 and took < limit_s / 2, (plain, other)
                assert max(other_kill, recount) < limit_s / 2, (other_kill, recount)
                killed = await _timed(helper.kill_uid(29992))
                after = await _timed(helper.recount())
                assert max(killed, after) < limit_s / 2, (killed, after)
                took, failed = await hung
                assert failed == (spawner.SOURCE_STEP, errno.ETIMEDOUT), failed
                assert limit_s <= took < limit_s + 2, took
                took, busy = await same
                assert busy == (spawner.SOURCE_STEP, spawner.SOURCE_BUSY), busy
                assert helper.hung_checkers == 1
        finally:
            helper.close()

    asyncio.run(scenario())


def test_starts_that_waited_for_a_check_that_timed_out_fail_with_it(root: Path) -> None:
    """Where SIGKILL ends a checker that did not answer (the first open of a FUSE mount
    whose server reads nothing, as on a hard NFS mount whose server is gone) it is reaped
    and none hangs: the starts of the same path that waited for that check fail with it
    (EBUSY) at the limit, rather than each check again and wait a limit more (three
    starts of a hung path would take three limits, a kill of their uid held back all
    along)."""
    binary = _binary(root)
    limit_s = 1.0

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        log = _log(root / "log")
        try:
            with unanswered_fuse(root / "jammed", probe=False) as mount:
                source = mount / "bin" / "task"
                launch = dataclasses.replace(_check(source), source_timeout_s=limit_s)
                await helper.ready()
                began = time.monotonic()

                async def start() -> tuple[int, float]:
                    with pytest.raises(spawner.SpawnFailed) as failed:
                        await helper.spawn(launch, log)
                    return failed.value.errno, time.monotonic() - began

                first = asyncio.create_task(start())
                await asyncio.sleep(0.1)  # its check begun: the next two wait for it
                waited = [asyncio.create_task(start()) for _ in range(2)]
                results = await asyncio.wait_for(asyncio.gather(first, *waited), 10)
                assert results[0][0] == errno.ETIMEDOUT and results[0][1] >= limit_s, results
                for err, took in results[1:]:
                    # (a start that checked again would end a whole limit later, at 2 limits)
                    assert err == spawner.SOURCE_BUSY and took < 1.9 * limit_s, results
                # its checker killed and reaped: the SIGKILL is sent at the limit, the
                # reap comes when the kernel has ended it (on a loaded machine a while
                # after the failed starts' replies), so asked until it is counted out
                deadline = time.monotonic() + 5.0
                await helper.recount()
                while helper.hung_checkers and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    await helper.recount()
                assert helper.hung_checkers == 0
        finally:
            os.close(log)
            helper.close()

    asyncio.run(scenario())


def test_a_burst_of_checked_starts_all_start(root: Path) -> None:
    """A burst of checked starts of one source: checked one after another (one check of a
    path at a time), they wait in the helper's pending table (128 in spawn.c), none fails
    for it (no EAGAIN), each one started."""
    binary = _binary(root)

    async def scenario() -> list[object]:
        helper = spawner.Helper(binary)
        log = _log(root / "log")

        async def spawn() -> object:
            try:
                _, exited = await helper.spawn(_check(Path("/bin/true"), healthy=True), log)
                return (await exited)[0]
            except spawner.SpawnFailed as failed:
                return failed.step, failed.errno

        try:
            return await asyncio.wait_for(asyncio.gather(*(spawn() for _ in range(100))), 30)
        finally:
            os.close(log)
            helper.close()

    assert asyncio.run(scenario()) == [0] * 100


def test_a_uid_the_kernel_would_truncate_is_refused(root: Path) -> None:
    binary = _binary(root)

    async def spawn(uid: int) -> object:
        helper = spawner.Helper(binary)
        log = _log(root / "log")
        try:
            launch = spawner.Launch("/bin/true", ["true"], {}, "/", uid=uid, gid=29992)
            _, exited = await asyncio.wait_for(helper.spawn(launch, log), 10)
            return (await exited)[0]
        except spawner.SpawnFailed as failed:
            return failed.errno
        finally:
            os.close(log)
            helper.close()

    # 2**32 would be uid 0 to setfsuid and setresuid; 2**32 - 1 is their "unchanged".
    assert asyncio.run(spawn(2**32)) == errno.EINVAL
    assert asyncio.run(spawn(2**32 - 1)) == errno.EINVAL
    assert asyncio.run(spawn(29992)) == 0


class _Sealer:
    """``ArtifactCache.seal_local`` of a source as uid 29993, on the thread that opens
    files as attempts, each open and read given up after ``LIMIT_S``; ``healthy``: a
    source on a local file system (the digest it seals against)."""

    def __init__(self, root: Path) -> None:
        self.cache = ArtifactCache(root / "cache", open_timeout_s=LIMIT_S)
        self.folder = root / "sealed"
        self.folder.mkdir(mode=0o700)
        self.sealed = Sealed(self.folder, 2**20)
        self.healthy = root / "healthy.sh"
        self.healthy.write_bytes(b"#!/bin/sh\n")
        self.healthy.chmod(0o644)
        self.digest = hashlib.sha256(self.healthy.read_bytes()).hexdigest()

    def __call__(self, source: Path) -> tuple[float, Path | ArtifactError]:
        """How long it took, and the sealed copy or why not."""
        reader = Identity(29993, 29993)
        uri = source.as_uri()
        began = time.monotonic()
        work = in_open_thread(lambda: self.cache.seal_local(uri, self.digest, reader, self.sealed))
        try:
            return time.monotonic() - began, asyncio.run(asyncio.wait_for(work, 10))
        except ArtifactError as exc:
            return time.monotonic() - began, exc


def test_a_seal_whose_source_never_answers_fails_and_leaves_one_thread(root: Path) -> None:
    seal = _Sealer(root)

    def hanging() -> int:
        return sum(t.name == "open-with-limit" for t in threading.enumerate())

    with unanswered_fuse(root / "jammed") as mount:
        source = mount / "task.sh"
        took, failed = seal(source)
        assert isinstance(failed, ArtifactError) and failed.retryable, failed
        assert f"{source}: it did not answer within {LIMIT_S:g} s" in failed.reason
        assert LIMIT_S <= took < LIMIT_S + 2, took
        took, busy = seal(source)  # its open still hangs: this one fails at once
        assert isinstance(busy, ArtifactError) and "still hangs" in busy.reason, busy
        assert took < LIMIT_S, took
        # The thread that opens files as attempts goes on: a healthy source seals.
        took, copy = seal(seal.healthy)
        assert isinstance(copy, Path) and copy.read_bytes() == seal.healthy.read_bytes()
        assert hanging() == 2  # the one left to the open, and the spare
        assert artifacts._guard.hanging() == [str(source)]
    # The mount gone, the open returns (ENOTCONN) and its thread ends: the spare is left.
    deadline = time.monotonic() + 10
    while (artifacts._guard.hanging() or hanging() > 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert artifacts._guard.hanging() == [] and hanging() == 1
    assert isinstance(seal(seal.healthy)[1], Path)


def test_a_seal_whose_source_opens_but_never_reads_fails_after_the_limit(root: Path) -> None:
    """A file system that answers the open and hangs on the read: the seal's reads are
    bounded as its open is, the copy begun is removed, the read's thread is left to it
    (one, until the read returns) and the open thread goes on."""
    seal = _Sealer(root)
    with unread_fuse(root / "unread", "task.sh", 4096) as source:
        took, failed = seal(source)
        assert isinstance(failed, ArtifactError) and failed.retryable, failed
        assert f"{source}: it did not answer within {LIMIT_S:g} s" in failed.reason
        assert LIMIT_S <= took < LIMIT_S + 2, took
        assert artifacts._guard.hanging() == [str(source)] and artifacts.hung_opens() == 1
        assert list(seal.folder.iterdir()) == []  # the copy begun is gone
        took, busy = seal(source)  # its read still hangs: this fails at once
        assert isinstance(busy, ArtifactError) and "still hangs" in busy.reason, busy
        assert took < LIMIT_S, took
        took, copy = seal(seal.healthy)
        assert isinstance(copy, Path) and copy.read_bytes() == seal.healthy.read_bytes()
    deadline = time.monotonic() + 10
    while artifacts._guard.hanging() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert artifacts._guard.hanging() == [] and artifacts.hung_opens() == 0
