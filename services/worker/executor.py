"""Running one attempt on this host: a child process in its own session and working
directory, its output in a log file, bounded by a hard timeout and a memory limit, and
measured (peak memory, CPU seconds) when it ends.

Limits are rlimits. The memory limit is ``RLIMIT_DATA``: since Linux 4.7 it bounds a
process's private writable memory (heap, anonymous mmaps), which is what a memory hog
grows, while ``RLIMIT_AS`` also counts address space that runtimes such as the JVM, Go
and V8 reserve without using, and would fail them at start. It is per process, so a task
that forks N workers may use N times it. CPU is not limited: an rlimit can only cap total
CPU time, not a share; that needs cgroup v2, which this host does not delegate.

Measurement is the ``wait4`` rusage of the direct child: ``ru_maxrss`` (the largest
resident set of the child and of the descendants it waited for) and user + system time
(of the same processes). Descendants that are never waited for are not counted.

An attempt started by the spawn helper (``spawner``) is the helper's child: the helper
reaps it and reports its status and rusage, and signals reach it through the helper. One
forked by the agent (no C compiler) is the agent's: this module waits for it with
``wait4`` (through a pidfd), so no ``waitpid(-1)`` child watcher may run beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from libs.common.loglimit import DEFAULT_LOG_MAX_BYTES
from services.worker import tmpfs
from services.worker.artifacts import LOCAL_FS_TYPES
from services.worker.cgroups import AttemptCgroup
from services.worker.isolation import Sandbox
from services.worker.logfile import AttemptLog
from services.worker.spawner import (
    EXEC_STEP,
    SOURCE_BUSY,
    SOURCE_STEP,
    SOURCE_UNANSWERED,
    SOURCE_UNCHECKED,
    Counters,
    Exit,
    Helper,
    HelperGone,
    Launch,
    SpawnFailed,
)

Outcome = Literal["succeeded", "failed", "timeout", "killed", "oom_killed", "disk_exceeded"]
StopReason = Literal["timeout", "stalled", "terminated", "cancelled", "preempted", "unhealthy"]

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOG_TAIL_BYTES = 4096
_Exit = Exit
#: the few tasks an attempt's end needs (a stop, a log's rest), held until they are done
_tasks: set[asyncio.Task[None]] = set()
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05


@dataclass(frozen=True)
class AttemptSpec:
    """What to run for one attempt, and within which bounds.

    ``env`` is laid over a minimal base (``PATH``, ``HOME`` = ``workdir``, ``LANG``); the
    ``CAIRN_*`` identity variables are set last and cannot be overridden by it.
    ``kill_grace_s`` is how long a timed-out attempt has between SIGTERM and SIGKILL.
    ``sandbox`` (uid, cgroups, private /tmp, rlimits) replaces the plain ``RLIMIT_DATA``;
    ``cgroup`` then holds the whole attempt: signals reach every process in it, and peak
    memory, CPU time and OOM kills are read from it. With ``helper`` (``spawner``) the
    process is started by that resident helper, which applies the same sandbox, instead
    of a fork of the agent: inside the helper's own cgroup (a v1 pool slot), or straight
    into a v2 ``cgroup``. The process's output goes through a pipe into ``log_path``,
    kept to its last ``log_max_bytes`` (``logfile.AttemptLog``).
    """

    executable: Path
    workdir: Path
    log_path: Path
    task_id: int
    attempt_id: int
    attempt_number: int
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    input_path: str | None = None
    output_path: str | None = None
    timeout_s: float | None = None
    #: no progress written for this long ends it as ``timeout`` (the agent watches:
    #: ``RunningAttempt.terminate(why="stalled")``, docs/progress.md)
    progress_timeout_s: float | None = None
    memory_mb: int | None = None
    cpu: float | None = None
    kill_grace_s: float = 5.0
    sandbox: Sandbox | None = None
    cgroup: AttemptCgroup | None = None
    tmpdir: str | None = None
    helper: Helper | None = None
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES
    #: the size of its tmpfs (``sandbox.mount``), its disk quota
    disk_mb: int | None = None


@dataclass(frozen=True)
class AttemptResult:
    """How an attempt ended.

    ``outcome`` is ``killed`` when the process died of a signal; ``stopped`` then says
    whether the worker stopped it (``terminated``, ``preempted`` or ``cancelled``) or
    not (``None``: something else killed it, such as the kernel's OOM killer).
    """

    outcome: Outcome
    exit_code: int | None
    signal: int | None
    peak_memory_mb: float | None
    cpu_seconds: float | None
    started_at: datetime
    ended_at: datetime
    duration_s: float
    error: str | None
    log_tail: str
    stopped: StopReason | None = None


class SpawnError(Exception):
    """The attempt's process could not be started; ``retryable``: the task's retry policy
    may try it again (else its failure is final)."""

    retryable = False


class SourceChanged(SpawnError):
    """Its spawn helper found the attempt's ``file://`` source not the file of the stamp
    it was prepared with (``Sandbox.source_check``): nothing of it ran, and nothing was
    written to its log; ``Host.launch`` seals the source again."""


class SourceUnchecked(SpawnError):
    """The attempt's spawn helper could not check its ``file://`` source (``SOURCE_UNCHECKED``:
    a fault of this agent, which says nothing of the source): nothing of it ran, and it is
    handed back (no attempt spent; ``WorkerAgent._spawn``)."""

    retryable = True


class SourceUnanswered(SourceUnchecked):
    """The attempt's ``file://`` source did not answer its spawn helper's open in time
    (``Sandbox.source_timeout_s``: a file system that hangs, such as a FUSE mount whose
    server does not reply): nothing of it ran. Not sealed again (that open would hang
    the agent's thread on the same path), and the source's next starts on this agent
    fail at once for a while (``Host.launch``); handed back, as the host's fault."""


class RunningAttempt:
    """A started attempt. ``wait()`` for its result, ``terminate()`` to stop it gently
    (drain, preemption) or ``kill()`` to stop it at once; all act on its process group.
    ``log`` is its output, open until ``log.close()`` (after the shipper's last read)."""

    def __init__(
        self,
        spec: AttemptSpec,
        pid: int,
        started: float,
        log: AttemptLog,
        exited: asyncio.Future[_Exit] | None = None,
        parent: Helper | None = None,
    ):
        """``exited``: its end as ``parent``, the spawn helper that started and reaps it,
        reports it; None: a child of the agent's, reaped here (``_watch_exit``).

        No task of its own: its end is a callback on ``exited`` that settles its result
        (a task only where its log's rest must wait on a cut, or its parent died), and its
        timeout a timer."""
        self.spec = spec
        self.pid = pid
        self.log = log
        self._started_wall = datetime.now(UTC)
        self._started = started
        self._stopped: StopReason | None = None
        self._detail: str | None = None  # why it was stopped as ``unhealthy``
        self._parent = parent
        self._exit: asyncio.Future[_Exit] = exited or _watch_exit(pid, spec.cgroup)
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._result_future: asyncio.Future[AttemptResult] = loop.create_future()
        #: the futures of ``wait`` calls, settled with the result (``_settle_waiters``)
        self._waiters: list[asyncio.Future[AttemptResult]] = []
        self._timer: asyncio.TimerHandle | None = None
        if spec.timeout_s is not None:
            self._timer = loop.call_later(spec.timeout_s, self._timed_out)
        if parent is not None and exited is not None:
            parent.on_exit(pid, exited, self._exited)  # called as its exit record is read
        else:
            self._exit.add_done_callback(self._exited)

    @property
    def done(self) -> bool:
        return self._result_future.done()

    async def wait(self) -> AttemptResult:
        """The result, once the process has ended. Cancelling this wait leaves it running.

        Each wait is a future of its own, settled together with the result
        (``_settle_waiters``): what ``asyncio.shield`` does, less its pass of the event
        loop between the result and the waiter."""
        if self._result_future.done():
            return self._result_future.result()
        waiter: asyncio.Future[AttemptResult] = self._loop.create_future()
        self._waiters.append(waiter)
        return await waiter

    def _settle_waiters(self) -> None:
        """The result is settled: every ``wait`` still waiting gets it."""
        waiters, self._waiters = self._waiters, []
        result = self._result_future
        for waiter in waiters:
            if waiter.done():  # its waiting task was cancelled
                continue
            if result.cancelled():
                waiter.cancel()
            elif (failure := result.exception()) is not None:
                waiter.set_exception(failure)
            else:
                waiter.set_result(result.result())

    async def terminate(
        self, grace_s: float = 10.0, why: StopReason = "terminated", detail: str | None = None
    ) -> AttemptResult:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; the result. ``detail``
        is the error of an ``unhealthy`` stop (a failed probe: ``probes``)."""
        if self._exit.done():
            return await self.wait()
        if self._stopped is None:
            self._detail = detail
        self._stopped = self._stopped or why
        await self._stop(grace_s)
        return await self.wait()

    def kill(self) -> None:
        """SIGKILL the process group now."""
        if self._exit.done():
            return
        self._stopped = self._stopped or "cancelled"
        self._signal(signal.SIGKILL)

    def _timed_out(self) -> None:
        self._timer = None
        if self._exit.done():
            return
        self._stopped = self._stopped or "timeout"
        _keep(self._stop_quietly(self.spec.kill_grace_s))

    async def _stop_quietly(self, grace_s: float) -> None:
        with contextlib.suppress(HelperGone):
            await self._stop(grace_s)

    def _exited(self, exit: asyncio.Future[_Exit]) -> None:
        """Its process ended (or its parent died): settle the result, here where nothing
        of it waits (mostly), else in a task."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if exit.cancelled():
            self._result_future.cancel()
            self._settle_waiters()
            return
        failure = exit.exception()
        if isinstance(failure, HelperGone):
            _signal_cgroup(self.spec.cgroup, signal.SIGKILL)  # an orphan now: stopped
            _keep(self._settle(self._orphaned_after_drain()))
            return
        if failure is not None:
            self._result_future.set_exception(failure)
            self._settle_waiters()
            return
        try:
            status, usage = ended = exit.result()
            counters: Counters | None = getattr(ended, "counters", None)
            if counters is None or not counters.final:
                counters = None
            group = self.spec.cgroup
            if self._parent is not None and group is not None:
                if counters is not None:
                    group.settled = True  # its helper saw nothing of it left in the slot
                else:
                    group.settle()  # its process group the helper killed
            if not self.log.drained_now():
                _keep(self._settle(self._result_after_drain(status, usage, counters)))
                return
            result = self._result(status, usage, counters)
        except BaseException as exc:  # the waiter has it
            self._result_future.set_exception(exc)
            self._settle_waiters()
            return
        self._result_future.set_result(result)
        self._settle_waiters()

    async def _settle(self, result: Awaitable[AttemptResult]) -> None:
        try:
            got = await result
        except BaseException as exc:  # the waiter has it
            if not self._result_future.done():
                self._result_future.set_exception(exc)
                self._settle_waiters()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not self._result_future.done():
            self._result_future.set_result(got)
            self._settle_waiters()

    async def _result_after_drain(
        self, status: int, usage: resource.struct_rusage, counters: Counters | None
    ) -> AttemptResult:
        await self.log.drained()
        return self._result(status, usage, counters)

    async def _orphaned_after_drain(self) -> AttemptResult:
        await self.log.drained()
        return self._orphaned()

    def _orphaned(self) -> AttemptResult:
        """Its parent, the spawn helper, died before it ended: its exit status is lost,
        and it was stopped (its cgroup killed; without one, ``Host.stop_leftovers`` kills
        its uid's processes)."""
        outcome: Outcome = "failed"
        error: str | None = (
            "its spawn helper (its parent) died: the attempt was stopped, its exit status lost"
        )
        if self._stopped is not None:
            outcome, error = _judge(None, None, self._stopped, self.spec, self._detail)
        group = self.spec.cgroup
        outcome, error = self._memory_verdict(outcome, error)
        return self._ended(
            outcome,
            error,
            None,
            None,
            group.peak_memory_mb() if group is not None else None,
            group.cpu_seconds() if group is not None else None,
        )

    async def _stop(self, grace_s: float) -> None:
        self._signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await asyncio.shield(self._exit)
        except TimeoutError:
            self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self._exit.done():  # reaped: the group is gone and its id may be reused
            return
        if self._parent is not None:
            self._parent.signal(self.pid, signum)  # it alone knows whether it reaped it
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signum)
        _signal_cgroup(self.spec.cgroup, signum)

    def _result(
        self, status: int, usage: resource.struct_rusage, counters: Counters | None = None
    ) -> AttemptResult:
        """``counters``: its slot's final figures as its helper read them (then no cgroup
        file is read here)."""
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        outcome, error = _judge(exit_code, signum, self._stopped, self.spec, self._detail)
        group = self.spec.cgroup
        peak = round(usage.ru_maxrss / 1024, 3)  # Linux reports KiB
        cpu = round(usage.ru_utime + usage.ru_stime, 3)
        oom_kills = None
        if counters is not None:
            peak = round(counters.peak_bytes / 2**20, 3) or peak
            cpu = round(counters.cpu_ns / 1e9, 3) or cpu
            oom_kills = counters.oom_kills
        elif group is not None:
            peak = group.peak_memory_mb() or peak
            cpu = group.cpu_seconds() or cpu
        outcome, error = self._memory_verdict(outcome, error, oom_kills)
        if outcome in ("failed", "killed") and self._stopped is None and self._disk_full():
            outcome = "disk_exceeded"
            error = (
                f"disk quota exceeded: its files filled the attempt's {self.spec.disk_mb} MB "
                "(a write failed with ENOSPC)"
            )
        return self._ended(outcome, error, exit_code, signum, peak, cpu)

    def _memory_verdict(
        self, outcome: Outcome, error: str | None, oom_kills: int | None = None
    ) -> tuple[Outcome, str | None]:
        """Any process of the attempt killed for memory makes it an OOM kill, even if its
        leader shrugged that off and exited 0 (or its exit status was lost). ``oom_kills``:
        as its helper counted them; None: read from its cgroup."""
        group = self.spec.cgroup
        if (
            group is not None
            and outcome in ("succeeded", "failed", "killed")
            and self._stopped is None
            and (oom_kills if oom_kills is not None else group.oom_kills())
        ):
            return "oom_killed", (
                f"out of memory: killed at the attempt's limit of {group.memory_mb} MB"
            )
        return outcome, error

    def _ended(
        self,
        outcome: Outcome,
        error: str | None,
        exit_code: int | None,
        signum: int | None,
        peak: float | None,
        cpu: float | None,
    ) -> AttemptResult:
        return AttemptResult(
            outcome=outcome,
            exit_code=exit_code,
            signal=signum,
            peak_memory_mb=peak,
            cpu_seconds=cpu,
            started_at=self._started_wall,
            ended_at=datetime.now(UTC),
            duration_s=time.monotonic() - self._started,
            error=error,
            log_tail=read_tail(self.spec.log_path, log=self.log),
            stopped=self._stopped,
        )

    def _disk_full(self) -> bool:
        mount = self.spec.sandbox.mount if self.spec.sandbox else None
        return mount is not None and tmpfs.full(mount)


def _keep(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(work)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def _judge(
    exit_code: int | None,
    signum: int | None,
    stopped: StopReason | None,
    spec: AttemptSpec,
    detail: str | None = None,
) -> tuple[Outcome, str | None]:
    if stopped == "unhealthy":
        return "failed", detail or "a probe failed"
    if stopped == "timeout":
        return "timeout", f"timed out after {spec.timeout_s:g} s"
    if stopped == "stalled":
        return (
            "timeout",
            f"stalled: no progress for {spec.progress_timeout_s:g} s (progress_timeout_s)",
        )
    if stopped is not None:
        return "killed", f"{stopped} by the worker"
    if signum is not None:
        return "killed", f"killed by signal {signum} ({signal.Signals(signum).name})"
    if exit_code == 0:
        return "succeeded", None
    return "failed", f"exited {exit_code}"


async def start_attempt(
    spec: AttemptSpec, unsettled: Callable[[asyncio.Future[None]], None] | None = None
) -> RunningAttempt:
    """Start the attempt's process in a process group of its own (a new session where the
    agent forks it; the spawn helper's own where it starts it); raises ``SpawnError`` if
    it cannot. Cancelled after its spawn helper was asked, what that start runs is killed
    and ``unsettled`` given the future of its end (``Helper.spawn_counted``): what the
    attempt holds is handed back only once it is settled (``Host.release``)."""
    # A home that is the attempt's tmpfs is the mount point its start attaches it on
    # (``workdirs.Workdirs.mount_point``), made with the run folder: not looked at here.
    mounted = spec.sandbox is not None and spec.sandbox.mount is not None
    for folder in (spec.log_path.parent,) if mounted else (spec.workdir, spec.log_path.parent):
        if not os.path.isdir(folder):  # one stat where it is there, as it mostly is
            folder.mkdir(parents=True, exist_ok=True)
    group = spec.cgroup
    log = AttemptLog(spec.log_path, spec.log_max_bytes)
    exited: asyncio.Future[_Exit] | None = None
    parent: Helper | None = None
    try:
        # A v1 cgroup is joined only by being forked inside it, by its slot's own helper.
        if spec.helper is not None and (group is None or group.version == "v2" or group.resident):
            parent = spec.helper
            started, pid, exited = await _start_by_helper(spec, parent, log, unsettled)
        else:
            started, pid = _fork(spec, log)
    except BaseException:
        log.close()
        raise
    log.started()
    return RunningAttempt(spec, pid, started, log, exited, parent)


def _fork(spec: AttemptSpec, log: AttemptLog) -> tuple[float, int]:
    """Start the process by a fork of the agent; (when, its pid)."""
    if spec.sandbox is not None and spec.sandbox.source_check is not None:
        raise SourceChanged("a fork of the agent checks no source: sealed again first")
    if spec.cgroup is not None and spec.cgroup.quota_at_exec is not None:
        raise SpawnError("a fork of the agent cannot apply its slot's CPU quota at exec")
    started = time.monotonic()
    try:
        process = subprocess.Popen(  # noqa: S603 - no shell; the task's own argv
            [str(spec.executable), *spec.args],
            stdin=subprocess.DEVNULL,
            stdout=log.writer,
            stderr=subprocess.STDOUT,
            cwd=spec.workdir,
            env=child_env(spec),
            start_new_session=True,
            preexec_fn=spec.sandbox.preexec() if spec.sandbox else _limits(spec),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.note(f"cairn: cannot start {spec.executable}: {exc}\n")
        why = getattr(exc, "strerror", None) or exc
        raise SpawnError(f"cannot start {spec.executable}: {why}") from exc
    # The Popen object is dropped: this module reaps the child itself (``_watch_exit``).
    process.returncode = 0
    return started, process.pid


async def _start_by_helper(
    spec: AttemptSpec,
    helper: Helper,
    log: AttemptLog,
    unsettled: Callable[[asyncio.Future[None]], None] | None = None,
) -> tuple[float, int, asyncio.Future[_Exit]]:
    into: int | None = None
    try:
        group = spec.cgroup
        if group is not None and group.version == "v2" and group.resident is None:
            into = os.open(group.folders[""], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        started = time.monotonic()
        mount = spec.sandbox.mount if spec.sandbox else None
        pid, exited, oom_base = await helper.spawn_counted(
            _launch(spec), log.writer, into, mount, unsettled
        )
        if group is not None and oom_base >= 0:
            # Its helper reset the slot's counters before the start (``CgroupPool.take``).
            group.oom_base, group.cpu_base = oom_base, 0.0
    except (SpawnFailed, HelperGone, OSError, ValueError) as exc:
        if isinstance(exc, SpawnFailed) and exc.step == SOURCE_STEP:
            if exc.errno in SOURCE_UNANSWERED | SOURCE_UNCHECKED:
                failure: SourceUnchecked
                if exc.errno in SOURCE_UNCHECKED:
                    failure = unchecked(spec, exc.errno)
                else:
                    still = "an earlier check of it still hangs" if exc.errno == SOURCE_BUSY else ""
                    failure = unanswered(spec, still)
                log.note(f"cairn: {failure}\n")
                raise failure from exc
            raise SourceChanged(f"{spec.sandbox and spec.sandbox.source_check}: {exc}") from exc
        if isinstance(exc, SpawnFailed) and exc.step == EXEC_STEP:
            why = os.strerror(exc.errno)
        else:
            why = f"cannot isolate it ({exc})"
        log.note(f"cairn: cannot start {spec.executable}: {why}\n")
        raise SpawnError(f"cannot start {spec.executable}: {why}") from exc
    finally:
        if into is not None:
            os.close(into)
    return started, pid, exited


def unanswered(spec: AttemptSpec, context: str = "") -> SourceUnanswered:
    """The failure of a start whose ``file://`` source check did not answer in time
    (``SOURCE_UNANSWERED``); ``context``: which check (another one's, still hanging)."""
    sandbox = spec.sandbox
    source = sandbox.source_check[0] if sandbox and sandbox.source_check else "?"
    limit = sandbox.source_timeout_s if sandbox and sandbox.source_timeout_s else 0.0
    why = f"its file:// source {source} did not answer within {limit:g} s"
    if context:
        why += f" ({context})"
    why += ": its file system hangs (CAIRN_WORKER_SOURCE_TIMEOUT_S)"
    return SourceUnanswered(f"cannot start {spec.executable}: {why}")


def unchecked(spec: AttemptSpec, error: int) -> SourceUnchecked:
    """The failure of a start whose spawn helper could not check its ``file://`` source
    (``SOURCE_UNCHECKED``: ``error``, its errno)."""
    sandbox = spec.sandbox
    source = sandbox.source_check[0] if sandbox and sandbox.source_check else "?"
    why = os.strerror(error)
    if error == errno.EAGAIN:
        why = "too many of its checks still hang or wait, or none could be made"
    elif error == errno.ECANCELED:
        why = "a kill of its uid came while it was checked"
    return SourceUnchecked(
        f"cannot start {spec.executable}: this worker could not check its file:// source"
        f" {source} ({why}): a fault of the worker, not of the source"
    )


def _launch(spec: AttemptSpec) -> Launch:
    """What the helper applies: the same as ``Sandbox.preexec`` (or ``_limits``)."""
    sandbox = spec.sandbox
    rlimits: tuple[tuple[int, int], ...] = ()
    if sandbox is None and spec.memory_mb is not None:
        rlimits = ((resource.RLIMIT_DATA, _data_limit(spec.memory_mb)),)
    identity = sandbox.identity if sandbox else None
    private_tmp = sandbox.private_tmp if sandbox else None
    check = sandbox.source_check if sandbox else None
    return Launch(
        executable=str(spec.executable),
        argv=[str(spec.executable), *spec.args],
        env=child_env(spec),
        workdir=str(spec.workdir),
        uid=identity.uid if identity else None,
        gid=identity.gid if identity else None,
        rlimits=sandbox.rlimits if sandbox else rlimits,
        private_tmp=str(private_tmp) if private_tmp is not None else None,
        tmp_targets=sandbox.tmp_targets if sandbox else (),
        shm=bool(sandbox and sandbox.shm),
        netns=bool(sandbox and sandbox.netns),
        ipc=bool(sandbox and sandbox.ipc),
        mount_at=sandbox.home if sandbox and sandbox.mount is not None else None,
        bind_from=sandbox.bind[0] if sandbox and sandbox.bind else None,
        source=check[0] if check else None,
        source_stamp=check[1] if check else None,
        source_types=LOCAL_FS_TYPES,
        source_timeout_s=sandbox.source_timeout_s if sandbox else None,
        cpu_quota=spec.cgroup.quota_at_exec if spec.cgroup is not None else None,
    )


async def run_attempt(spec: AttemptSpec) -> AttemptResult:
    """Run the attempt to its end. A process that cannot start is a ``failed`` result.

    Cancelling this kills the process group, then re-raises ``CancelledError``.
    """
    try:
        running = await start_attempt(spec)
    except SpawnError as exc:
        now = datetime.now(UTC)
        return AttemptResult(
            "failed", None, None, None, None, now, now, 0.0, str(exc), read_tail(spec.log_path)
        )
    try:
        return await running.wait()
    except asyncio.CancelledError:
        running.kill()
        with contextlib.suppress(asyncio.CancelledError):
            await running.wait()
        raise
    finally:
        running.log.close()


def child_env(spec: AttemptSpec) -> dict[str, str]:
    """The child's whole environment."""
    env = {"PATH": BASE_PATH, "HOME": str(spec.workdir), "LANG": "C.UTF-8"}
    if spec.tmpdir:
        env["TMPDIR"] = spec.tmpdir
    env.update(spec.env)
    env.update(
        CAIRN_TASK_ID=str(spec.task_id),
        CAIRN_ATTEMPT_ID=str(spec.attempt_id),
        CAIRN_ATTEMPT_NUMBER=str(spec.attempt_number),
        CAIRN_INPUT_PATH=spec.input_path or "",
        CAIRN_OUTPUT_PATH=spec.output_path or "",
    )
    return env


def read_tail(path: Path, size: int = LOG_TAIL_BYTES, log: AttemptLog | None = None) -> str:
    """The last ``size`` bytes of a log (through ``log``'s descriptor while it is open),
    decoded; a character cut in two is dropped."""
    tail = log.tail(size) if log is not None else None
    if tail is None:
        try:
            with path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - size))
                tail = f.read()
        except FileNotFoundError:
            return ""
    cut = 0
    while cut < min(3, len(tail)) and 0x80 <= tail[cut] < 0xC0:
        cut += 1
    return tail[cut:].decode("utf-8", errors="replace")


def _limits(spec: AttemptSpec) -> Callable[[], None] | None:
    """What the child runs between fork and exec: only a prepared ``setrlimit`` call."""
    if spec.memory_mb is None:
        return None
    limit = _data_limit(spec.memory_mb)
    pair = (limit, limit)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, pair)

    return apply


def _data_limit(memory_mb: int) -> int:
    limit = memory_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    return limit if hard == resource.RLIM_INFINITY else min(limit, hard)


def _watch_exit(pid: int, group: AttemptCgroup | None = None) -> asyncio.Future[_Exit]:
    """A future of the child's wait status and rusage, settled the moment it exits: a
    pidfd on the event loop (no thread); where a pidfd cannot be had, or the process
    exited but is not yet waitable (a thread outlived its leader), ``wait4`` is retried
    on a timer."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_Exit] = loop.create_future()

    def settle(reaped: _Exit | BaseException) -> None:
        if future.done():
            return
        if isinstance(reaped, BaseException):
            future.set_exception(reaped)
        else:
            future.set_result(reaped)

    def poll(delay: float) -> None:
        if future.done():
            return
        try:
            reaped = _reap_if_exited(pid, group)
        except ChildProcessError as exc:
            settle(exc)
            return
        if reaped is None:
            loop.call_later(delay, poll, min(delay * 2, _POLL_MAX_S))
        else:
            settle(reaped)

    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        loop.call_soon(poll, _POLL_FIRST_S)
        return future

    def readable() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        poll(_POLL_FIRST_S)

    loop.add_reader(pidfd, readable)
    return future


def _reap_if_exited(pid: int, group: AttemptCgroup | None) -> _Exit | None:
    """Reap the child if it has exited (killing what it left first); None if it runs."""
    exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if exited is None:
        return None
    return _reap(pid, os.WNOHANG, group)


def _reap(pid: int, options: int, group: AttemptCgroup | None = None) -> _Exit | None:
    """Kill what the exited leader left in its group, then reap the leader.

    While the leader is an unreaped zombie its pid, the group id, cannot be reused, so
    the group signal reaches only the attempt's own processes.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if group is not None:
        group.settle()
    reaped_pid, status, usage = os.wait4(pid, options)
    return Exit(status, usage) if reaped_pid == pid else None


def _signal_cgroup(group: AttemptCgroup | None, signum: int) -> None:
    """Signal every process of the attempt's cgroup (those that left its process group)."""
    if group is None:
        return
    if signum == signal.SIGKILL:
        group.kill_all()
        return
    for pid in group.pids():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
