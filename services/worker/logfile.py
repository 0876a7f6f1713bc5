"""An attempt's log file on the worker's disk, bounded as core's copy is (docs/logs.md).

The attempt's stdout and stderr are the write end of a pipe, and the agent moves what
comes out of it into the file with ``splice`` (the kernel moves the pages: no copy
through Python, no work per line). Every attempt's pipe is watched by one epoll of the
agent's (``_Pumps``), itself one reader of the event loop: a pipe costs a register and
an unregister, and a task that prints nothing mostly no wake-up of its own where a spawn
helper started it (the helper holds a copy of the write end until it sends the attempt's
exit record, so the pipe ends with the record, whose handling drains it: ``drained_now``);
one at its end, shared with every other pipe ready then, where the agent forked it.

Why a pipe: a file the task wrote itself could not be bounded. ``RLIMIT_FSIZE`` caps
every file the process writes, its own results too, not one descriptor; and a truncate
every few tenths of a second lets ``yes`` or ``dd``, which write at page-cache speed
(GB/s), run far past any bound between two passes. Through the pipe, nothing reaches the
disk unless the agent writes it.

The rule is core's (``libs.common.loglimit``, the same ``CAIRN_LOG_MAX_BYTES``): the file
keeps the attempt's last ``limit`` bytes of output. Once it holds a quarter more, its
last ``limit`` bytes are copied (``copy_file_range``, by the kernel, in a thread) into a
new file that starts with core's marker line, ``[cairn: the first N bytes of this log
were dropped: ...]``, and replaces it; the output waits in the pipe meanwhile. So the
file never holds more than ``limit * 5 / 4`` bytes, a pipe's worth (64 KiB: what one
splice moved past the mark) and a line; the task keeps running,
and the end of its log, where the error is, is always there.

Positions (``size``, ``read``) are of the output, not of the file, so the shipper's
offsets, and core's copy, do not move when the file is cut: core marks what the shipper
never sent as skipped, as for a shipper that fell behind. The marker line is the file's,
never shipped.

Past its first ``limit`` bytes a task's output is moved at most ``OVERFLOW_BYTES_S``
(the task then waits on its writes): the agent's CPU is every attempt's, and output that
fast is dropped anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import threading
import time
import weakref
from pathlib import Path

from libs.common.loglimit import dropped_marker

logger = logging.getLogger("cairn.worker.logfile")

#: what one wake-up moves at most before it lets the event loop go on
MOVE_BYTES = 1 << 20
#: how fast output is moved once the log overflows its bound (bytes a second)
OVERFLOW_BYTES_S = 16 * 2**20
_OPEN = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
#: the pipe's side of a splice never waits (the descriptor itself blocks: the child's
#: end of the same pipe must, and setting our end apart would cost two more calls)
_SPLICE = os.SPLICE_F_NONBLOCK
_READY = 256  # pipes handled per wake-up at most; the rest stay ready for the next


class AttemptLog:
    """The log file of one attempt at ``path``, kept to its last ``limit`` bytes; see
    the module's docstring. ``writer`` is the descriptor the child's output goes to."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.slack = limit // 4
        self._fd = os.open(path, _OPEN, 0o600)
        self._end = os.fstat(self._fd).st_size  # the output's length so far
        self._base = 0  # the output position of the file's first byte after the marker
        self._head = 0  # the marker line's length
        self._lock = threading.Lock()  # the shipper reads in a thread while a cut swaps
        self._pipe, self.writer = os.pipe2(os.O_CLOEXEC)  # both block: see _SPLICE
        self._pumps: _Pumps | None = None
        self._reading = False
        self._draining = False
        self._ended = False  # the pipe's end was read: no writer is left
        self._dropping = False  # the file could not be written: output was dropped
        self._broken = False  # moving failed unexpectedly: the rest is dropped unread
        self._cutting: asyncio.Task[None] | None = None
        self._resume: asyncio.TimerHandle | None = None
        self._budget = -1  # what the drain may still move (-1: it has not begun)
        self._drain_done = False  # the drain found the pipe's end, or nothing more

    # --- the agent's side ---

    def started(self) -> None:
        """The child holds the pipe's write end: drop ours (an agent with many slots
        would run short of descriptors), and move its output as it comes."""
        self._close_writer()
        self._pumps = _pumps()
        self._listen()

    def note(self, text: str) -> None:
        """Append a line of the agent's own (why the process could not start)."""
        data = text.encode()
        os.pwrite(self._fd, data, self._at(self._end))
        self._end += len(data)

    async def drained(self) -> None:
        """The process has ended: move what it left in the pipe (no more than the bound
        holds: a process that escaped the attempt may still be writing), then close the
        pipe."""
        self._begin_drain()
        if self._cutting is not None:
            await self._cutting
        while True:
            if self._over():
                await asyncio.to_thread(self._cut)
            if self._drain_moves():
                break
        self._close_pipe()

    def drained_now(self) -> bool:
        """``drained`` on the spot, where none of it waits (no cut under way nor due, as
        for nearly every attempt): whether it was done; if not, ``await drained()``
        finishes it."""
        self._begin_drain()
        if self._cutting is not None or self._over() or not self._drain_moves():
            return False
        self._close_pipe()
        return True

    def _begin_drain(self) -> None:
        self._draining = True
        self._close_writer()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._unlisten()
        if self._budget < 0:
            self._budget = self.limit + self.slack

    def _drain_moves(self) -> bool:
        """Move what is left in the pipe, within the drain's budget; False when the file
        is over its bound first (cut it, then call again)."""
        while self._pipe >= 0 and self._budget > 0 and not self._ended and not self._drain_done:
            before = self._end
            ended = self._move(self._budget)
            self._budget -= self._end - before
            if ended or self._end == before:
                self._drain_done = True
            if self._over():
                return False
        return True

    def _close_pipe(self) -> None:
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1

    def close(self) -> None:
        """Close the pipe and the file (after the shipper sent the rest)."""
        self._unlisten()
        self._close_writer()
        for fd in (self._pipe, self._fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._pipe = self._fd = -1

    # --- the shipper's side (``logship.LogSource``) ---

    def size(self) -> int:
        """How many bytes of output there were so far, kept or not."""
        return self._end

    def read(self, offset: int, most: int) -> tuple[int, bytes]:
        """Up to ``most`` bytes of output from ``offset``, or from the first one still
        kept if it is later; (where they start, the bytes). Safe in a thread."""
        with self._lock:
            start = max(offset, self._base)
            count = min(most, self._end - start)
            if count <= 0 or self._fd < 0:
                return start, b""
            return start, os.pread(self._fd, count, self._at(start))

    def tail(self, most: int) -> bytes | None:
        """The file's last ``most`` bytes (the marker line too, if they reach it), read
        through its descriptor; None once it is closed."""
        with self._lock:
            if self._fd < 0:
                return None
            length = self._at(self._end)
            if length == 0:  # nothing written (nor a marker): no read
                return b""
            start = max(0, length - most)
            return os.pread(self._fd, length - start, start)

    # --- moving and cutting ---

    def _at(self, position: int) -> int:
        """Where an output position is in the file."""
        return self._head + position - self._base

    def _over(self) -> bool:
        return self._end - self._base > self.limit + self.slack

    def _listen(self) -> None:
        if self._pumps is not None and not (self._reading or self._draining) and self._pipe >= 0:
            self._pumps.add(self._pipe, self)
            self._reading = True

    def _unlisten(self) -> None:
        if self._pumps is not None and self._reading:
            self._pumps.remove(self._pipe)
            self._reading = False

    def pump(self) -> None:
        """The pipe is readable (``_Pumps``): move what it holds; at its end, stop
        listening; over the bound, stop until the file is cut."""
        if self._move(MOVE_BYTES):
            self._unlisten()
        elif self._over():
            self._unlisten()
            self._cutting = asyncio.get_running_loop().create_task(self._cut_then_listen())

    def broken(self, exc: BaseException) -> None:
        """Moving this log failed unexpectedly (``_Pumps``): drop the rest of its output
        as it comes, so the task's writes never wait on a pipe nobody reads; the file
        keeps the marker."""
        self._broken = True
        self._drop_all(exc if isinstance(exc, OSError) else OSError(repr(exc)))
        self._listen()

    def _skip(self, most: int) -> bool:
        """Drop up to ``most`` bytes from the pipe, unread; whether it ended."""
        moved = 0
        while moved < most:
            try:
                step = os.splice(self._pipe, _null_fd(), most - moved, flags=_SPLICE)
            except BlockingIOError:
                return False
            if step == 0:
                self._ended = True
                return True
            moved += step
            self._end += step
            self._base = self._end  # nothing past the marker is kept
        return False

    def _move(self, most: int) -> bool:
        """Splice up to ``most`` bytes from the pipe into the file; whether it ended."""
        if self._broken:
            return self._skip(most)
        moved = 0
        emptied = False  # the file was just emptied to its marker and has not taken a byte
        while moved < most:
            try:
                at = self._at(self._end)
                step = os.splice(self._pipe, self._fd, most - moved, offset_dst=at, flags=_SPLICE)
            except BlockingIOError:
                return False
            except OSError as exc:  # the file cannot take it (a full disk)
                if not emptied:
                    # What the file holds is dropped, not what the pipe holds: the newest
                    # output (a task's last lines, read with the rest) goes to the file
                    # emptied to its marker.
                    self._drop_all(exc)
                    emptied = True
                    continue
                # Not even an empty file takes it: the pipe's bytes are dropped.
                step = _discard(self._pipe, most - moved)
                self._end += step
                self._drop_all(exc)
                if step == 0:
                    return False
                moved += step
                continue
            if step == 0:
                self._ended = True
                return True
            self._end += step
            moved += step
            emptied = False
            if self._over():
                return False
        return False

    async def _cut_then_listen(self) -> None:
        began = time.monotonic()
        try:
            await asyncio.to_thread(self._cut)
        finally:
            self._cutting = None
        # Over the bound: no faster than OVERFLOW_BYTES_S (the slack moved per cut).
        wait = began + self.slack / OVERFLOW_BYTES_S - time.monotonic()
        if wait > 0:
            self._resume = asyncio.get_running_loop().call_later(wait, self._listen_again)
        else:
            self._listen()

    def _listen_again(self) -> None:
        self._resume = None
        self._listen()

    def _cut(self) -> None:
        """Keep the last ``limit`` bytes: copied into a new file after the marker, which
        then replaces the file (the pump waits meanwhile: ``_end`` does not move)."""
        keep_from = self._end - self.limit
        marker = dropped_marker(keep_from, self.limit).encode()
        kept = self.path.with_name(f".{self.path.name}.kept")
        try:
            fd = os.open(kept, _OPEN | os.O_TRUNC, 0o600)
        except OSError as exc:
            self._drop_all(exc)
            return
        try:
            os.pwrite(fd, marker, 0)
            _copy(self._fd, self._at(keep_from), fd, len(marker), self.limit)
            os.replace(kept, self.path)
        except OSError as exc:
            os.close(fd)
            kept.unlink(missing_ok=True)
            self._drop_all(exc)
            return
        with self._lock:
            old, self._fd = self._fd, fd
            self._head, self._base = len(marker), keep_from
            os.close(old)

    def _drop_all(self, exc: OSError) -> None:
        """A file that cannot be written or cut (a full disk) keeps nothing but the
        marker: the bound holds, and the task runs on."""
        if not self._dropping:  # once: a full disk would say so at every pipe-full
            logger.warning("the log %s is dropped (%s): its file cannot be written", self.path, exc)
        self._dropping = True
        marker = dropped_marker(self._end, self.limit).encode()
        with self._lock, contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            self._head, self._base = 0, self._end
            os.pwrite(self._fd, marker, 0)
            self._head = len(marker)

    def _close_writer(self) -> None:
        if self.writer >= 0:
            os.close(self.writer)
            self.writer = -1


def _discard(pipe: int, most: int) -> int:
    """Drop up to ``most`` bytes the pipe holds, by the kernel; how many."""
    try:
        return os.splice(pipe, _null_fd(), most, flags=_SPLICE)
    except BlockingIOError:
        return 0


def _null_fd() -> int:
    """/dev/null, opened once for the agent."""
    global _null
    if _null < 0:
        _null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    return _null


_null = -1


def _copy(src: int, at: int, dst: int, to: int, count: int) -> None:
    """``count`` bytes from ``src`` at ``at`` into ``dst`` at ``to``, by the kernel."""
    done = 0
    while done < count:
        step = os.copy_file_range(src, dst, count - done, at + done, to + done)
        if step == 0:
            raise OSError(f"the log ended {count - done} bytes early")
        done += step


class _Pumps:
    """One epoll for the pipes of every attempt on an event loop, read by one reader of
    the loop: registering a pipe here is one system call, where a reader of its own
    costs the loop's bookkeeping twice per attempt."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._epoll = select.epoll()
        self._logs: dict[int, AttemptLog] = {}
        loop.add_reader(self._epoll.fileno(), self._ready)

    def add(self, pipe: int, log: AttemptLog) -> None:
        self._epoll.register(pipe, select.EPOLLIN)
        self._logs[pipe] = log

    def remove(self, pipe: int) -> None:
        del self._logs[pipe]
        self._epoll.unregister(pipe)

    def _ready(self) -> None:
        for pipe, _ in self._epoll.poll(0, _READY):
            log = self._logs.get(pipe)
            if log is not None:
                try:
                    log.pump()
                except Exception as exc:  # one log's trouble must not stop the others'
                    logger.exception("the log %s keeps no more output", log.path)
                    log.broken(exc)


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pumps] = weakref.WeakKeyDictionary()


def _pumps() -> _Pumps:
    """The running loop's ``_Pumps``, made on first use."""
    loop = asyncio.get_running_loop()
    pumps = _loops.get(loop)
    if pumps is None:
        pumps = _loops[loop] = _Pumps(loop)
    return pumps
