"""Starting attempts without forking the agent: ``cairn-spawn`` (``spawn.c``), a small C
process started once with ``posix_spawn``, forks each attempt on request and is its parent.

The agent is a large Python process; forking it for every attempt (``subprocess`` with
``preexec_fn``) copies its page tables and runs Python between fork and exec. The helper
is 18 KB of C: its fork is cheap, and it applies the sandbox (session, private mount
namespace with the attempt's tmpfs as its home (``tmpfs``), network namespace for egress
``none``, rlimits, uid and gid, no_new_privs, umask, working directory, descriptors)
itself before it execs the task. It reaps its attempts with ``wait4`` and sends each
one's exit record (wait status, user and system CPU, peak resident set) on the same
socket as its replies, those that ended together in one message, closing its copy of
each one's log pipe right before (so the pipe's end comes with the record, which drains
it, not at the attempt's exit: ``logfile``); one reader on the
agent's event loop settles each attempt's end future from it, so the agent keeps no
pidfd, watcher or thread per attempt (``Helper``). A helper resident in a cgroup v1 slot
also keeps the slot's counters: it resets them before each start and reads them at the
exit (``Counters``, in the exit record), so the agent reads no cgroup file for them. Signals to an attempt go through the
helper too, which alone knows whether its pid is still its unreaped child. If a helper
dies, its attempts still running become orphans: their futures end with ``HelperGone``
and the agent stops them through their cgroup or uid (``executor``). On cgroup v1 a
helper lives inside each pooled cgroup (it joined it once), so an attempt it starts is
born there: no ``cgroup.procs`` write per attempt (``cgpool``). On cgroup v2 one helper
starts every attempt straight into its cgroup (``clone3`` with ``CLONE_INTO_CGROUP``).

The helper is compiled from ``spawn.c`` with the host's C compiler, once per source
version, into the package's ``_bin`` folder (``make install`` does it) or, when that is not
writable, the agent's home; without a compiler the agent starts attempts with
``preexec_fn`` as before (its own children then, reaped through a pidfd). It is run only
when it and its folder belong to the agent's user and nobody else may write them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hashlib
import logging
import os
import re
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("cairn.worker.spawner")

SOURCE = Path(__file__).with_name("spawn.c")
#: what the helper sends: a reply (kind 1: pid, step, errno, the slot's OOM-kill count
#: before a start, its hung checkers, and the number of its request: 1 for the first that
#: has a reply, 0 the ready message) to each request that has one, and exit records (kind
#: 2: a count, then each one's pid, wait status, user and system CPU in microseconds, peak
#: resident set in KiB, and its slot's ``Counters``). Replies come in the order of their
#: requests, except a start's whose source is checked: it comes when its check ends, and
#: the helper answers later requests meanwhile.
_KIND = struct.Struct("=i")
_REPLY = struct.Struct("=iiiiqqq")
_EXITS = struct.Struct("=ii")
_EXIT = struct.Struct("=iiqqqqqii")
_REPLY_KIND, _EXITS_KIND = 1, 2
#: a CPU quota the helper writes (``Launch.cpu_quota``): v1's one number, v2's two
_QUOTA = re.compile(r"[0-9]{1,18}( [0-9]{1,18})?")
#: the largest message the helper sends (256 exit records)
_MAX_MESSAGE = _EXITS.size + 256 * _EXIT.size
_STEPS = {
    1: "process group",
    2: "private mounts",
    3: "rlimits",
    4: "uid and gid",
    5: "no_new_privs",
    6: "working directory",
    7: "descriptors",
    8: "exec",
    9: "clone",
    10: "network namespace",
    11: "file:// source",
    12: "IPC namespace",
    13: "keyrings",
    14: "CPU quota",
}
EXEC_STEP = 8
#: the step at which the spawn helper found a ``file://`` source not the file of its stamp
SOURCE_STEP = 11
#: its errno there when the source's open did not answer in time (ETIMEDOUT), or while an
#: earlier check of the same source that did not answer still hangs (EBUSY)
SOURCE_BUSY = errno.EBUSY
SOURCE_UNANSWERED = frozenset({errno.ETIMEDOUT, SOURCE_BUSY})
#: its errno there when the checking itself failed, which says nothing of the source: too
#: many checkers of other paths still hang, or too many starts (or bytes of their
#: requests) wait for their checks already (EAGAIN), the checker died unanswered (EIO), no checker could be made (EAGAIN,
#: ENOMEM), the request was refused (EINVAL), no file could be opened at all (EMFILE,
#: ENFILE), or a kill of its uid came while it was checked (ECANCELED: it never started).
#: Any other errno (ESTALE: another file; the open's own: ENOENT, EACCES...) says the
#: source is not the file of its stamp.
SOURCE_UNCHECKED = frozenset(
    {
        errno.EAGAIN,
        errno.EIO,
        errno.ENOMEM,
        errno.EINVAL,
        errno.EMFILE,
        errno.ENFILE,
        errno.ECANCELED,
    }
)


class SpawnFailed(Exception):
    """The helper could not start the attempt; ``step`` says where, ``errno`` why."""

    def __init__(self, step: int, errno: int, pid: int = 0) -> None:
        self.step = step
        self.errno = errno
        self.pid = pid
        what = _STEPS.get(step, f"step {step}")
        super().__init__(f"{what}: {os.strerror(errno) if errno > 0 else 'refused'}")


#: every helper started and not closed (``hung_checkers``)
_helpers: weakref.WeakSet[Helper] = weakref.WeakSet()


def hung_checkers() -> int:
    """The checker processes of sources that did not answer that the agent's helpers
    still hold aside, as each helper's last reply said (a gauge of the worker's)."""
    return sum(helper.hung_checkers for helper in list(_helpers) if not helper.gone)


async def recount_hung() -> None:
    """``Helper.recount`` of each helper whose last reply said some of its checkers hang
    (none asked otherwise); a helper gone meanwhile is passed over."""
    for helper in list(_helpers):
        if helper.hung_checkers and not helper.gone:
            with contextlib.suppress(HelperGone):
                await helper.recount()


class HelperGone(Exception):
    """The helper process exited (killed, or it could not join its cgroups)."""


#: a reply: pid, step, errno, the slot's OOM-kill count before the start (-1: none), and
#: for a started attempt the future of its end
_Reply = tuple[int, int, int, int, "asyncio.Future[Exit] | None"]


@dataclass(frozen=True)
class Counters:
    """An attempt's cgroup v1 slot as its helper read it when the attempt was reaped:
    peak memory (bytes) and CPU (ns) since the helper reset them before the start, OOM
    kills since then (-1 for what it could not read), and ``alone``: the slot then held
    no process but the helper, so nothing of the attempt was left (the slot is empty and
    these figures are final)."""

    peak_bytes: int
    cpu_ns: int
    oom_kills: int
    alone: bool

    @property
    def final(self) -> bool:
        return self.alone and min(self.peak_bytes, self.cpu_ns, self.oom_kills) >= 0


class Exit(tuple[int, resource.struct_rusage]):
    """An attempt's end as its parent saw it: the wait status and its rusage (user and
    system CPU, peak resident set; the other fields are 0), and ``counters``, its slot's
    (None where its helper keeps none)."""

    counters: Counters | None

    def __new__(
        cls, status: int, usage: resource.struct_rusage, counters: Counters | None = None
    ) -> Exit:
        self = super().__new__(cls, (status, usage))
        self.counters = counters
        return self


def _usage(utime_us: int, stime_us: int, maxrss_kb: int) -> resource.struct_rusage:
    fields = [0.0] * 16
    fields[0], fields[1], fields[2] = utime_us / 1e6, stime_us / 1e6, maxrss_kb
    return resource.struct_rusage(fields)


@dataclass(frozen=True)
class Launch:
    """One attempt, as the helper reads it."""

    executable: str
    argv: Sequence[str]
    env: Mapping[str, str]
    workdir: str
    uid: int | None = None
    gid: int | None = None
    rlimits: Sequence[tuple[int, int]] = ()
    private_tmp: str | None = None
    tmp_targets: Sequence[str] = ()
    shm: bool = False
    #: egress ``none``: a network namespace of its own, loopback only
    netns: bool = False
    #: an IPC namespace of its own (``Sandbox.ipc``)
    ipc: bool = False
    #: where the passed tmpfs (``tmpfs``) is attached: the attempt's home
    mount_at: str | None = None
    #: the sealed copy bound on ``executable`` in the attempt's mount namespace
    bind_from: str | None = None
    #: a ``file://`` source checked before anything else, opened as the attempt: it must
    #: be the file of this stamp (``artifacts.Stamp``) on a file system of one of these
    #: ``statfs`` types, else the start fails at ``SOURCE_STEP``; within
    #: ``source_timeout_s``, else it fails there with ETIMEDOUT (``SOURCE_UNANSWERED``)
    source: str | None = None
    source_stamp: tuple[int, int, int, int, int] | None = None
    source_types: str = ""
    source_timeout_s: float | None = None
    #: the attempt's CPU quota, which the helper writes once it has exec'd: ``US`` to
    #: its v1 slot's ``cpu.cfs_quota_us`` (``sets_quota``; ``cgpool.CgroupPool.take``),
    #: or ``US PERIOD`` to the passed cgroup2 folder's ``cpu.max``
    #: (``cgroups.Cgroups.create``)
    cpu_quota: str | None = None

    def encode(self, with_cgroup: bool) -> bytes:
        fields = [f"x{self.executable}", *(f"a{a}" for a in self.argv)]
        fields += [f"e{k}={v}" for k, v in self.env.items()]
        fields.append(f"d{self.workdir}")
        if self.uid is not None and self.gid is not None:
            fields += [f"u{self.uid}", f"g{self.gid}"]
        fields += [f"r{which}={value}" for which, value in self.rlimits]
        if self.mount_at is not None:
            fields.append(f"m{self.mount_at}")
        if self.bind_from is not None:
            fields.append(f"b{self.bind_from}")
        fields += self._source_fields()
        if self.private_tmp is not None:
            fields.append(f"t{self.private_tmp}")
            fields += [f"T{target}" for target in self.tmp_targets]
        flags = (
            (self.private_tmp is not None and self.shm, "s"),
            (self.netns, "n"),
            (self.ipc, "i"),
            (with_cgroup, "c"),
        )
        fields += [tag for on, tag in flags if on]
        if self.cpu_quota is not None:
            if not _QUOTA.fullmatch(self.cpu_quota):
                raise ValueError(f"not a CPU quota: {self.cpu_quota!r}")
            fields.append(f"q{self.cpu_quota}")
        data = "\0".join(fields)
        if data.count("\0") != len(fields) - 1:
            raise ValueError("an argument or environment entry holds a NUL byte")
        return data.encode() + b"\0"

    def _source_fields(self) -> list[str]:
        if self.source is None or self.source_stamp is None:
            return []
        if self.source_timeout_s is None:
            raise ValueError("a source check needs its time limit")
        stamp = ":".join(map(str, self.source_stamp))
        limit_ms = max(1, round(self.source_timeout_s * 1000))
        return [f"o{self.source}", f"O{stamp}", f"F{self.source_types}", f"W{limit_ms}"]


class Helper:
    """One resident ``cairn-spawn`` process (started with ``posix_spawn``), the parent of
    the attempts it starts; ``join`` names the cgroup.procs files it enters once at start.

    One reader on the event loop takes everything it sends: the replies to requests, each
    matched to its request by number (``_REPLY``), and the exit records of its attempts,
    several to a message when they end together. An attempt's end is a future (``spawn``)
    settled from its record: no watcher, thread or system call of the agent's per
    attempt."""

    def __init__(self, binary: Path, join: Sequence[str] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 21)
        try:
            os.set_inheritable(theirs.fileno(), True)
            self.pid = os.posix_spawn(
                binary,
                [str(binary), "zygote", str(theirs.fileno()), *join],
                {},
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                ],
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD),
                setsigmask=(),
            )
        finally:
            theirs.close()
        self._sock = ours
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the replies awaited, by the number of their request (0: the ready message)
        self._replies: dict[int, asyncio.Future[_Reply]] = {}
        self._sent = 0
        #: requests the socket had no room for yet (a burst of large ones: it holds about
        #: 2 MB), each with the reply it awaits (None: a signal's), sent in order as the
        #: helper reads (``_drain``); a request meanwhile goes after them
        self._backlog: collections.deque[
            tuple[bytes, Sequence[int], asyncio.Future[_Reply] | None]
        ] = collections.deque()
        self._ready_reply: asyncio.Future[_Reply] | None = None
        #: the attempts it started that have not ended, by pid
        self._exits: dict[int, asyncio.Future[Exit]] = {}
        #: what is called with each one's end future as its exit record is read (``on_exit``)
        self._on_exit: dict[int, Callable[[asyncio.Future[Exit]], None]] = {}
        #: starts sent whose caller stopped waiting (cancelled) before it had their reply,
        #: by the future of that reply: each one's end, settled once what it started has
        #: ended (``_abandon``, ``_unwaited``)
        self._abandoned: dict[asyncio.Future[_Reply], asyncio.Future[None]] = {}
        self._ready = False
        self.gone = False
        #: it keeps its cgroup v1 slot's counters (its ready message says so): resets
        #: them before each start, reads them at each exit (``Counters``)
        self.counts = False
        #: it can write its cgroup v1 slot's CPU quota once a start has exec'd
        #: (``Launch.cpu_quota``; its ready message says so)
        self.sets_quota = False
        #: user + system CPU seconds of the attempts it reaped (their own rusage)
        self.reaped_cpu_s = 0.0
        #: its checkers of sources that did not answer that still hang, as its last reply
        #: said (``hung_checkers``)
        self.hung_checkers = 0
        _helpers.add(self)
        # Readable once the helper has exited: ``alive`` asks it, no /proc read.
        self._exit: select.poll | None = None
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(self.pid)
            self._exit = select.poll()
            self._exit.register(self._pidfd, select.POLLIN)

    def _listen(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the first use, or a new event loop since
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
                self._loop.remove_writer(self._sock.fileno())
            self._loop = loop
            self._sock.setblocking(False)
            loop.add_reader(self._sock.fileno(), self._readable)
            if self._backlog:
                loop.add_writer(self._sock.fileno(), self._drain)
        return loop

    def _readable(self) -> None:
        """One message the helper sent: a reply settles the future of the request of its
        number (one nobody awaits any more is dropped), exit records their attempts'
        futures. One a wake-up: the socket stays readable while more wait (the loop's
        epoll is level-triggered), and no call is spent on finding it empty, which it
        mostly is."""
        if self.gone:
            return
        try:
            data = self._sock.recv(_MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        (kind,) = _KIND.unpack_from(data) if len(data) >= _KIND.size else (0,)
        if kind == _REPLY_KIND and len(data) == _REPLY.size:
            self._replied(*_REPLY.unpack(data)[1:])
        elif kind == _EXITS_KIND and len(data) >= _EXITS.size:
            self._ended(data)
        else:  # end of file: it exited
            self.close()

    def _replied(self, pid: int, step: int, errno: int, oom_base: int, hung: int, seq: int) -> None:
        self.hung_checkers = hung
        exited = None
        if not step and pid > 0 and self._ready and self._loop is not None:
            # Before the next message, which may be its exit record.
            exited = self._exits[pid] = self._loop.create_future()
        reply = self._replies.pop(seq, None)
        if reply is not None and not reply.done():
            reply.set_result((pid, step, errno, oom_base, exited))
        elif exited is not None or self._abandoned:
            self._unwaited(reply, pid, exited)

    def _unwaited(
        self, reply: asyncio.Future[_Reply] | None, pid: int, exited: asyncio.Future[Exit] | None
    ) -> None:
        """A reply whose caller stopped waiting: a start that failed settles its end now
        (nothing of it runs); one that started is killed at once (``_stop_unwaited``).
        Its end is kept for its caller where that caller has not yet resumed (its
        cancellation came in this same pass of the event loop: ``_abandon`` takes it)."""
        ended = self._abandoned.pop(reply, None) if reply is not None else None
        if exited is not None:
            stopped = self._stop_unwaited(pid, exited, ended)
            if ended is None and reply is not None and reply.cancelled():
                self._abandoned[reply] = stopped  # for its caller, about to resume
        elif ended is not None and not ended.done():
            ended.set_result(None)

    def _stop_unwaited(
        self, pid: int, exited: asyncio.Future[Exit], ended: asyncio.Future[None] | None = None
    ) -> asyncio.Future[None]:
        """Its attempt ``pid`` started for a caller who no longer waits for it: its process
        group killed now, and ``ended`` (made if None) settled from its exit record, or the
        helper's end, as an attempt's end is (``on_exit``): only then may what it held (its
        slot, its uid, its folders) be handed back."""
        if ended is None:
            ended = self._listen().create_future()

        def settle(_: asyncio.Future[Exit]) -> None:
            if not ended.done():
                ended.set_result(None)

        if not exited.done():
            self.signal(pid, signal.SIGKILL)
        self.on_exit(pid, exited, settle)
        return ended

    def _abandon(
        self,
        reply: asyncio.Future[_Reply],
        unsettled: Callable[[asyncio.Future[None]], None] | None,
    ) -> None:
        """A start whose caller stopped waiting (cancelled) is settled all the same: one
        still waiting for room is never sent (``_drain``); one sent is killed as soon as
        its reply says it started (``_unwaited``), or now if that reply came already.
        ``unsettled`` is given the future of its end (the caller's release awaits it)."""
        if self.gone or self._loop is None:
            return  # its attempts are orphans, stopped through their cgroup or uid (``close``)
        if not reply.cancelled():  # answered, its caller cancelled before it resumed
            if reply.exception() is not None:
                return
            pid, step, _, _, exited = reply.result()
            if step or exited is None:
                return
            ended = self._stop_unwaited(pid, exited)
        elif (answered := self._abandoned.pop(reply, None)) is not None:
            ended = answered  # it started, and was killed, before its caller resumed
        elif any(waiting is reply for waiting in self._replies.values()):
            ended = self._abandoned[reply] = self._loop.create_future()  # sent, unanswered
        else:
            return  # never sent (it waited for room), or it failed: nothing of it runs
        if unsettled is not None:
            unsettled(ended)

    def _ended(self, data: bytes) -> None:
        _, count = _EXITS.unpack_from(data)
        for i in range(min(count, (len(data) - _EXITS.size) // _EXIT.size)):
            pid, status, utime_us, stime_us, maxrss_kb, peak, cpu_ns, kills, alone = (
                _EXIT.unpack_from(data, _EXITS.size + i * _EXIT.size)
            )
            self.reaped_cpu_s += (utime_us + stime_us) / 1e6
            exited = self._exits.pop(pid, None)
            if exited is None:
                continue
            if not exited.done():
                counters = Counters(peak, cpu_ns, kills, alone == 1) if self.counts else None
                exited.set_result(Exit(status, _usage(utime_us, stime_us, maxrss_kb), counters))
            then = self._on_exit.pop(pid, None)
            if then is not None:
                try:
                    then(exited)
                except Exception:  # one attempt's trouble must not keep the others' ends
                    log.exception("the end of attempt pid %s was not taken", pid)

    def on_exit(
        self, pid: int, exited: asyncio.Future[Exit], then: Callable[[asyncio.Future[Exit]], None]
    ) -> None:
        """``then(exited)`` once ``exited``, the end future of its attempt ``pid``, is
        settled: on the spot where its exit record settles it (the reader calls it, no pass
        of the event loop in between, as there is for a done callback); as its done
        callback where it ends otherwise (the helper gone) or has ended already."""
        if self._exits.get(pid) is exited and not self.gone:
            self._on_exit[pid] = then
        else:
            exited.add_done_callback(then)

    def _gone(self) -> HelperGone:
        return HelperGone(f"the spawn helper (pid {self.pid}) is gone")

    async def _request(
        self,
        data: bytes,
        fds: Sequence[int] = (),
        start: bool = False,
        unsettled: Callable[[asyncio.Future[None]], None] | None = None,
    ) -> _Reply:
        if self.gone:
            raise self._gone()
        reply: asyncio.Future[_Reply] = self._listen().create_future()
        try:
            self._send_in_turn(data, fds, reply)
        except _Uncopied as exc:  # the agent's own descriptors ran out: this request fails
            raise exc.error from None
        except OSError:
            self.close()
            raise self._gone() from None
        try:
            return await reply
        except asyncio.CancelledError:
            if start:
                self._abandon(reply, unsettled)
            raise

    def _send_in_turn(
        self, data: bytes, fds: Sequence[int], reply: asyncio.Future[_Reply] | None
    ) -> None:
        """Send a request now, or once those waiting for room went (``_backlog``)."""
        if self._backlog or not self._send(data, fds, reply):
            # its own copies of the descriptors: the caller closes its own when it stops
            # waiting (cancelled), and a number closed there may name another file by the
            # time the request goes
            self._backlog.append((data, _copies(fds), reply))
            if len(self._backlog) == 1:
                self._listen().add_writer(self._sock.fileno(), self._drain)

    def _send(self, data: bytes, fds: Sequence[int], reply: asyncio.Future[_Reply] | None) -> bool:
        """One request sent, its reply awaited by its number; False: no room for it yet.
        Raises ``OSError`` if the helper is gone."""
        try:
            if fds:
                socket.send_fds(self._sock, [data], fds)
            else:
                self._sock.send(data)
        except BlockingIOError:
            return False
        if reply is not None:  # numbered in the order sent, as the helper reads them
            self._sent += 1
            self._replies[self._sent] = reply
        return True

    def _drain(self) -> None:
        """The socket has room: the requests waiting for it go, in order."""
        try:
            while self._backlog:
                data, fds, reply = self._backlog[0]
                # a start whose caller stopped waiting goes nowhere: it was never sent
                if (reply is None or not reply.done()) and not self._send(data, fds, reply):
                    return  # called again when there is room
                self._backlog.popleft()
                _close_all(fds)
        except OSError:
            self.close()
            return
        self._listen().remove_writer(self._sock.fileno())

    async def ready(self) -> None:
        """Wait for its start (and its move into the cgroups); raises ``HelperGone``."""
        if self._ready:
            return
        if self.gone:
            raise self._gone()
        loop = self._listen()
        if self._ready_reply is None:  # the first to ask waits for its ready message
            self._ready_reply = self._replies[0] = loop.create_future()
        ready = await asyncio.shield(self._ready_reply)
        flags = ready[3]  # the ready message's last field
        self.counts, self.sets_quota = bool(flags & 1), bool(flags & 2)
        self._ready = True

    async def spawn(
        self, launch: Launch, log_fd: int, cgroup_fd: int | None = None, mount: int | None = None
    ) -> tuple[int, asyncio.Future[Exit]]:
        """The started attempt's pid (a child of the helper) and the future of its end
        (its wait status and rusage; ``HelperGone`` if the helper died first);
        ``SpawnFailed`` if it failed before its exec (then already reaped),
        ``HelperGone`` if the helper died. ``mount``: the attempt's tmpfs, attached on
        ``launch.mount_at``."""
        pid, exited, _ = await self.spawn_counted(launch, log_fd, cgroup_fd, mount)
        return pid, exited

    async def spawn_counted(
        self,
        launch: Launch,
        log_fd: int,
        cgroup_fd: int | None = None,
        mount: int | None = None,
        unsettled: Callable[[asyncio.Future[None]], None] | None = None,
    ) -> tuple[int, asyncio.Future[Exit], int]:
        """``spawn``, and its slot's OOM-kill count before the start (-1 where the helper
        keeps no counters: ``counts``). Cancelled once its request went, the start is
        settled all the same (``_abandon``): what it started is killed at once, and
        ``unsettled`` is given the future of its end, which comes with its exit record
        (or the helper's end): what the attempt holds is handed back only then."""
        await self.ready()
        request = launch.encode(cgroup_fd is not None)
        fds = [log_fd] if cgroup_fd is None else [log_fd, cgroup_fd]
        if launch.mount_at is not None:
            if mount is None:
                raise ValueError("a mount point without its tmpfs")
            fds.append(mount)
        pid, step, errno, oom_base, exited = await self._request(request, fds, True, unsettled)
        if step:
            raise SpawnFailed(step, errno, pid)
        if exited is None:  # a reply that is no spawn's: the helper is out of step
            self.close()
            raise self._gone()
        return pid, exited, oom_base

    def signal(self, pid: int, signum: int) -> None:
        """Signal the process group of its attempt ``pid``, which it does only while it
        has not reaped it (a pid reaped may be another process's already). Nothing if the
        helper is gone."""
        if self.gone or pid <= 0:
            return
        with contextlib.suppress(OSError):  # gone: its reader sees the end
            self._send_in_turn(f"S{pid} {signum}".encode(), (), None)

    async def kill_uid(self, uid: int) -> None:
        """SIGKILL every process of ``uid`` (a child of the helper sends ``kill -9 -1``
        as that uid)."""
        await self.ready()
        await self._request(f"k{uid}".encode())

    async def recount(self) -> None:
        """``hung_checkers`` asked again: a checker that ended is counted out only at a
        request, so without one a helper that starts nothing would count it for good."""
        await self.ready()
        await self._request(b"h")

    def alive(self) -> bool:
        """Whether the helper still runs (not closed, not exited, not a zombie)."""
        if self.gone:
            return False
        if self._exit is not None:
            return not self._exit.poll(0)
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[:1] != ["Z"]

    def close(self) -> None:
        """Stop it. Attempts of its still running are orphans then: their futures end with
        ``HelperGone`` and the agent stops them through their cgroup or uid."""
        if self.gone:
            return
        self.gone = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        self._sock.close()  # end of file: the helper exits
        if self._exit is not None:
            self._exit = None
            os.close(self._pidfd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        unsent = [reply for _, _, reply in self._backlog if reply is not None]
        for _, fds, _ in self._backlog:
            _close_all(fds)
        self._backlog.clear()
        waiting: list[asyncio.Future[Any]] = [
            *self._replies.values(), *unsent, *self._exits.values()
        ]  # fmt: skip
        for future in waiting:
            if not future.done():
                future.set_exception(self._gone())
                future.exception()  # retrieved: one nobody waits for is no error
        for pid, then in self._on_exit.items():
            if (exited := self._exits.get(pid)) is not None:
                exited.add_done_callback(then)
        self._settle_abandoned()
        self._replies.clear()
        self._exits.clear()
        self._on_exit.clear()
        _reap_later(self.pid)

    def _settle_abandoned(self) -> None:
        """The helper is gone: the starts given up on are settled, never started or
        orphans now (stopped through their cgroup or uid by their release)."""
        for ended in self._abandoned.values():
            if not ended.done():
                ended.set_result(None)
        self._abandoned.clear()


class _Uncopied(Exception):
    """The descriptors of a request that waits for room could not be copied (EMFILE: the
    agent's table is full): that request fails alone, its helper is not at fault."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _copies(fds: Sequence[int]) -> list[int]:
    """Copies of ``fds`` (``os.dup``), all or none; raises ``_Uncopied``."""
    copies: list[int] = []
    try:
        for fd in fds:
            copies.append(os.dup(fd))
    except OSError as exc:
        _close_all(copies)
        raise _Uncopied(exc) from exc
    return copies


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _reap_later(pid: int) -> None:
    """Reap an exiting helper when it is gone, without blocking (a pidfd on the loop)."""
    try:
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(pid)
    except (RuntimeError, OSError):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        return

    def readable() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)

    loop.add_reader(pidfd, readable)


def _ours(path: Path) -> bool:
    """Whether ``path`` belongs to us, is no link, and nobody else may change it."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return (
        info.st_uid == os.geteuid() and not info.st_mode & 0o022 and not stat.S_ISLNK(info.st_mode)
    )


def _safe(path: Path) -> bool:
    """Whether ``path`` and its folder belong to us and nobody else may change them."""
    return _ours(path) and _ours(path.parent)


def _source_tag() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def build(folders: Sequence[Path]) -> Path | None:
    """The compiled helper for this source version, compiled into the first folder of
    ``folders`` that can hold it; None without a C compiler, without the source (an
    install that did not ship it), or with nowhere safe to put it."""
    try:
        tag = _source_tag()
    except OSError:
        return None
    for folder in folders:
        binary = folder / f"cairn-spawn-{tag}"
        if binary.exists():
            if _safe(binary):
                return binary
            continue
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o755)
        except OSError:
            continue
        if not os.access(folder, os.W_OK) or not _ours(folder):
            continue
        binary = folder / f"cairn-spawn-{tag}"
        partial = folder / f".cairn-spawn-{tag}.{os.getpid()}"
        try:
            subprocess.run(  # noqa: S603 - the host's compiler on our own source
                [compiler, "-O2", "-o", str(partial), str(SOURCE)],
                check=True,
                capture_output=True,
                timeout=120,
            )
            partial.chmod(0o755)
            os.replace(partial, binary)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("cannot compile the spawn helper into %s: %s", folder, exc)
            partial.unlink(missing_ok=True)
            continue
        return binary
    return None


def default_folders(home: Path) -> list[Path]:
    """Where the helper is looked for and built: beside this module, then ``home``/bin."""
    return [Path(__file__).with_name("_bin"), home / "bin"]


def main() -> None:
    """``python -m services.worker.spawner``: compile the helper (``make install``)."""
    binary = build(default_folders(Path.home() / ".cairn")[:1])
    sys.stdout.write(f"{binary or 'no C compiler: attempts start with preexec_fn'}\n")


if __name__ == "__main__":
    main()
