"""The spawn helper reads its socket at all times, whatever its source checks do (real
helpers, real FUSE mounts, as root): a kill of a uid whose start is being checked is
answered at once and that start never runs; a checked start that finds every pending
slot taken fails at once (EAGAIN, handed back) while signals, kills and other starts are
served; checkers that did not answer are let go without waiting for them to die, and
reaped as they end, no request needed. A kill names an attempt's uid, never root's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import resource
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.worker import spawner
from tests.support.fuse import FUSE_TYPE, unanswered_fuse, unread_fuse
from tests.support.procs import child_states
from tests.unit.worker.test_source_unanswered import (
    _binary,
    _check,
    _log,
    _Starts,
    _timed,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="root mounts FUSE itself"
)

PLAIN = spawner.Launch("/bin/true", ["true"], {}, "/")
SLEEPER = spawner.Launch("/bin/sleep", ["sleep", "30"], {}, "/")
#: arguments that make a start's request about 520 KB: 40 of them fill the socket
PAD = ["x" * 130_000] * 4
BIG = spawner.Launch("/bin/true", ["true", *PAD], {}, "/")


def test_a_kill_of_a_uid_whose_start_is_checked_is_answered_at_once(root: Path) -> None:
    """The agent kills a uid whose start it gave up on while its source was checked: the
    kill is answered at once and the helper goes on serving; that start never runs (its
    check answers later, it fails with ECANCELED, started by nobody), nor does another
    start of that uid still waiting for the check of its path (ECANCELED at once, before
    the kill's reply), while a start of that path by another uid waits and runs; a start
    of the same uid sent after the kill runs. The helper then holds no descriptor of
    theirs."""
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
            descriptors = len(os.listdir(f"/proc/{helper.pid}/fd"))
            held.set()  # its open waits, as on a slow file system
            checked = asyncio.create_task(start(launch))
            # Both wait for that check of their path (read in order, after it).
            queued = asyncio.create_task(start(launch))
            another = asyncio.create_task(start(dataclasses.replace(launch, uid=29995, gid=29995)))
            await asyncio.sleep(0.1)
            kill = await _timed(helper.kill_uid(29992))
            waited, result = await queued  # answered before the kill (else at the check's end)
            assert result == (spawner.SOURCE_STEP, errno.ECANCELED), result
            plain = await start(PLAIN)
            other = await _timed(helper.kill_uid(29993))
            assert not checked.done() and not another.done()
            times = (kill, waited, plain[0], other)
            assert max(times) < limit_s / 4 and plain[1] == 0, (times, plain)
            held.clear()  # its check answers: the source holds
            took, cancelled = await checked
            assert cancelled == (spawner.SOURCE_STEP, errno.ECANCELED), cancelled
            assert took < limit_s, took
            assert (await another)[1] == 0  # checked once the cancelled one's check ended
            assert errno.ECANCELED in spawner.SOURCE_UNCHECKED  # handed back, if awaited
            took, status = await start(launch)  # sent after the kill: not cancelled
            assert status == 0, status
            assert len(os.listdir(f"/proc/{helper.pid}/fd")) == descriptors
        finally:
            held.clear()
            helper.close()

    with unread_fuse(root / "slow", "task", 4096, held) as source:
        asyncio.run(scenario(source))


def test_a_full_pending_table_holds_back_no_signal_kill_or_start(root: Path) -> None:
    """128 starts (MAX_PENDING in spawn.c) wait for a check that hangs: the next checked
    start fails at once with EAGAIN (the checking's fault: handed back), and a signal to
    a running attempt, a kill and a start without a check are served at once."""
    binary = _binary(root)
    limit_s = 2.0

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        start = _Starts(helper, root)
        log = _log(root / "log")
        try:
            pid, exited = await helper.spawn(SLEEPER, log)
            with unanswered_fuse(root / "jammed") as mount:
                hung = dataclasses.replace(_check(mount / "task"), source_timeout_s=limit_s)
                waiting = [asyncio.create_task(start(hung)) for _ in range(128)]
                await asyncio.sleep(0.05)  # all sent
                await helper.recount()  # answered once all before it were read (in order):
                # one checked, 127 waiting for it
                full = await start(_check(Path("/bin/true"), healthy=True))
                plain = await start(PLAIN)
                kill = await _timed(helper.kill_uid(29993))
                helper.signal(pid, signal.SIGTERM)
                signalled = await _timed(exited)
                assert not any(task.done() for task in waiting)
                assert full[1] == (spawner.SOURCE_STEP, errno.EAGAIN), full
                assert errno.EAGAIN in spawner.SOURCE_UNCHECKED
                assert plain[1] == 0 and exited.result()[0] == signal.SIGTERM
                took = (full[0], plain[0], kill, signalled)
                assert max(took) < limit_s / 4, took
                results = [result for _, result in await asyncio.gather(*waiting)]
                assert results[0] == (spawner.SOURCE_STEP, errno.ETIMEDOUT), results
                assert set(results[1:]) == {(spawner.SOURCE_STEP, spawner.SOURCE_BUSY)}
        finally:
            os.close(log)
            helper.close()

    asyncio.run(scenario())


def test_the_bytes_pending_starts_keep_are_bounded_together(root: Path) -> None:
    """Starts of 520 KB requests wait for a check that hangs: past 16 MB of them together
    (PENDING_BYTES in spawn.c) the next fails at once with EAGAIN, though most of the 128
    slots are free (128 such requests held 66 MB, 1 MB ones 136 MB); a small checked
    start still fits and runs, and the waiting ones end as their check does."""
    binary = _binary(root)
    limit_s = 2.0
    big = ["true", *PAD]

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        start = _Starts(helper, root)
        try:
            with unanswered_fuse(root / "jammed") as mount:
                hung = dataclasses.replace(
                    _check(mount / "task"), argv=big, source_timeout_s=limit_s
                )
                starts = []
                for _ in range(40):
                    starts.append(asyncio.create_task(start(hung)))
                    # Answered once all before it were read (in order): no more than one
                    # such request at a time fills the agent's end of the socket.
                    await helper.recount()
                small = await start(_check(Path("/bin/true"), healthy=True))
                assert small[1] == 0 and small[0] < limit_s / 4, small
                ended = await asyncio.gather(*starts)
                refused = [took for took, r in ended if r == (spawner.SOURCE_STEP, errno.EAGAIN)]
                assert len(refused) in range(1, 11), ended  # 16 MB: 32 of 520 KB
                assert max(refused) < limit_s / 4, refused  # at once, not after the check
                waited = [r for _, r in ended if r != (spawner.SOURCE_STEP, errno.EAGAIN)]
                assert waited[0] == (spawner.SOURCE_STEP, errno.ETIMEDOUT), ended
                assert set(waited[1:]) == {(spawner.SOURCE_STEP, spawner.SOURCE_BUSY)}
        finally:
            helper.close()

    asyncio.run(scenario())


def test_a_burst_of_requests_past_the_sockets_room_waits_for_it_in_order(root: Path) -> None:
    """40 starts of 520 KB requests sent at once, 20 MB where the agent's end of the socket
    holds 2: those it has no room for wait for it and go in order (each reply is matched
    to its request by number), a signal sent meanwhile too; none is lost, the helper
    lives on (a full socket was taken for a helper gone: every attempt of it lost)."""
    binary = _binary(root)

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        start = _Starts(helper, root)
        log = _log(root / "log")
        try:
            pid, exited = await helper.spawn(SLEEPER, log)
            with _unread(helper):
                starts = [asyncio.create_task(start(BIG)) for _ in range(40)]
                await _turns(3)  # each sent, or waiting for room (``wait_for``: a task)
                helper.signal(pid, signal.SIGTERM)
                assert helper._backlog[-1][2] is None, "the signal did not wait its turn"
            assert [status for _, status in await asyncio.gather(*starts)] == [0] * 40
            assert (await asyncio.wait_for(exited, 10))[0] == signal.SIGTERM
            assert not helper.gone
            assert (await start(PLAIN))[1] == 0
        finally:
            os.close(log)
            helper.close()

    asyncio.run(scenario())


def test_a_start_given_up_while_it_waits_for_room_never_goes(root: Path) -> None:
    """A start that waits for the socket's room and whose caller stops waiting (cancelled:
    it closes its log) is never sent: not with the descriptor number it gave, which by
    then names another file (here the next one opened: the start's output went there)."""
    binary = _binary(root)
    marked = spawner.Launch("/bin/sh", ["sh", "-c", "echo MARK", *PAD], {}, "/")

    async def begin(launch: spawner.Launch, path: Path) -> int:
        log = _log(path)
        try:
            _, exited = await helper.spawn(launch, log)
            return (await exited)[0]
        finally:
            os.close(log)

    async def scenario() -> None:
        nonlocal helper
        helper = spawner.Helper(binary)
        await helper.ready()
        try:
            with _unread(helper):
                starts = [asyncio.create_task(begin(BIG, root / f"log{i}")) for i in range(40)]
                given_up = asyncio.create_task(begin(marked, root / "given-up"))
                await asyncio.sleep(0)  # each sent, or waiting for room
                assert helper._backlog, "the burst fit the socket: nothing waited"
                given_up.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await given_up
                other = _log(root / "other")
            try:
                assert await asyncio.gather(*starts) == [0] * 40
                await asyncio.sleep(0.2)  # a start that went would have printed by now
            finally:
                os.close(other)
            assert (root / "other").read_bytes() == b""
            assert not helper.gone
        finally:
            helper.close()

    helper: spawner.Helper
    asyncio.run(scenario())


def test_a_start_that_cannot_copy_its_descriptors_fails_alone(root: Path) -> None:
    """A start that waits for the socket's room copies its descriptors (``os.dup``): with
    the agent's descriptor table full (EMFILE), that start alone fails (``OSError``, as
    any start the agent cannot make), not the helper: it was closed for it, every attempt
    it ran lost. The helper then keeps no copy of the failed start's."""
    binary = _binary(root)

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        start = _Starts(helper, root)
        log = _log(root / "log")
        limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        filler: list[int] = []
        try:
            _, exited = await helper.spawn(SLEEPER, log)
            with _unread(helper):
                starts = [asyncio.create_task(start(BIG)) for _ in range(40)]
                await _turns(3)  # each sent, or waiting for room (``wait_for``: a task)
                assert helper._backlog, "the burst fit the socket: nothing waited"
                mine = set(os.listdir("/proc/self/fd"))
                top = max(map(int, mine)) + 1
                resource.setrlimit(resource.RLIMIT_NOFILE, (top, limits[1]))
                with contextlib.suppress(OSError):
                    while True:  # the holes below the limit taken: the table is full
                        filler.append(os.dup(log))
                with pytest.raises(OSError) as failed:
                    await helper.spawn(PLAIN, log)
                assert failed.value.errno == errno.EMFILE
                assert not helper.gone and not exited.done()
                _close(filler)
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            assert [status for _, status in await asyncio.gather(*starts)] == [0] * 40
            assert not helper._backlog and not helper.gone
            assert set(os.listdir("/proc/self/fd")) <= mine
        finally:
            _close(filler)
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            os.close(log)
            helper.close()

    asyncio.run(scenario())


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


@contextlib.contextmanager
def _unread(helper: spawner.Helper) -> Iterator[None]:
    """The helper stopped (SIGSTOP), reading nothing: a burst fills its socket however
    fast the machine is (a helper that kept up took all of it, and nothing waited)."""
    os.kill(helper.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper.pid, signal.SIGCONT)


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


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
                assert helper.hung_checkers == 8 and child_states(helper.pid).count("D") == 8
            deadline = time.monotonic() + 10
            while child_states(helper.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert child_states(helper.pid) == []  # not even zombies: reaped, nothing asked
            await helper.recount()
            assert helper.hung_checkers == 0
        finally:
            helper.close()

    asyncio.run(scenario())


def test_at_most_32_checks_run_at_once(root: Path) -> None:
    """40 starts of 40 paths under a mount that hangs: 32 checks run at once at most
    (MAX_CHECKING in spawn.c), the 8 other starts wait for a place, then fail with EAGAIN
    once 8 checkers hang (the checking's fault), or begin before that and time out."""
    binary = _binary(root)
    limit_s = 1.0

    async def scenario() -> None:
        helper = spawner.Helper(binary)
        start = _Starts(helper, root)
        try:
            await helper.ready()
            with unanswered_fuse(root / "jammed") as mount:
                starts = [
                    asyncio.create_task(
                        start(
                            dataclasses.replace(
                                _check(mount / f"d{n}" / "task"), source_timeout_s=limit_s
                            )
                        )
                    )
                    for n in range(40)
                ]
                await asyncio.sleep(0.05)  # all sent
                await helper.recount()  # all read: 32 begun, 8 waiting for a place
                assert len(child_states(helper.pid)) == 32 and not any(t.done() for t in starts)
                results = [result for _, result in await asyncio.gather(*starts)]
                # The first 32 time out; as each one ends, a waiting start may begin while
                # fewer than 8 hang (MAX_STUCK), the rest fail with EAGAIN.
                timed_out = results.count((spawner.SOURCE_STEP, errno.ETIMEDOUT))
                refused = results.count((spawner.SOURCE_STEP, errno.EAGAIN))
                assert 32 <= timed_out <= 39 and timed_out + refused == 40, results
                assert helper.hung_checkers == timed_out
        finally:
            helper.close()

    asyncio.run(scenario())


def test_a_kill_of_root_or_of_no_uid_kills_nothing(root: Path) -> None:
    """A kill names the uid of an attempt: uid 0 (its killer, root still, would send
    SIGKILL to every process there is) or -1 (no uid: setresuid leaves root) is refused,
    and an attempt running as root goes on. The helper runs as process 1 of a PID
    namespace of its own, so that one without this check kills nothing outside it."""
    binary, unshare = _binary(root), shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare (util-linux) to give the helper a PID namespace")
    wrapper = root / "in-own-pid-namespace"
    wrapper.write_text(f'#!/bin/sh\nexec {unshare} --pid --fork --kill-child {binary} "$@"\n')
    wrapper.chmod(0o755)

    async def scenario() -> None:
        helper = spawner.Helper(wrapper)
        log = _log(root / "log")
        try:
            sleeping = spawner.Launch("/bin/sleep", ["sleep", "30"], {}, "/")
            pid, exited = await asyncio.wait_for(helper.spawn(sleeping, log), 10)
            for uid in (0, -1):
                await _timed(helper.kill_uid(uid))
            await _timed(helper.kill_uid(29993))  # a uid of an attempt: as ever
            helper.signal(pid, signal.SIGTERM)
            status, _ = await asyncio.wait_for(exited, 10)
            assert status == signal.SIGTERM, status  # not SIGKILL: it outlived the kills
        finally:
            os.close(log)
            helper.close()

    asyncio.run(scenario())
