"""An attempt's log file on the worker's disk, bounded as core's copy is (docs/logs.md).

The attempt's stdout and stderr are the write end of a pipe, and the agent moves what
comes out of it into the file with ``splice`` (the kernel moves the pages: no copy
through Python, no work per line; a task that prints nothing costs one wake-up, at its
end). A file the task wrote itself could not be bounded: ``RLIMIT_FSIZE`` caps every file
the process writes, its own results too, not one descriptor; and a truncate every few
tenths of a second lets ``yes`` or ``dd``, which write at page-cache speed (GB/s), run far
past any bound between two passes. Through the pipe, nothing reaches the disk unless the
agent writes it.

The rule is core's (``libs.common.loglimit``, the same ``CAIRN_LOG_MAX_BYTES``): the file
keeps the attempt's last ``limit`` bytes of output. Once it holds a quarter more, its
last ``limit`` bytes are copied (``copy_file_range``, by the kernel, in a thread) into a
new file that starts with core's marker line, ``[cairn: the first N bytes of this log
were dropped: ...]``, and replaces it; the output waits in the pipe meanwhile. So the
file never holds more than ``limit * 5 / 4`` bytes and a line, the task keeps running,
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
import threading
import time
from pathlib import Path

from libs.common.loglimit import dropped_marker

log = logging.getLogger("cairn.worker.logfile")

#: what one wake-up moves at most before it lets the event loop go on
MOVE_BYTES = 1 << 20
#: how fast output is moved once the log overflows its bound (bytes a second)
OVERFLOW_BYTES_S = 16 * 2**20
_OPEN = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


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
        self._pipe, self.writer = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._pipe, False)  # ours only: the child's end blocks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._draining = False
        self._cutting: asyncio.Task[None] | None = None
        self._resume: asyncio.TimerHandle | None = None

    # --- the agent's side ---

    def started(self) -> None:
        """The child holds the pipe's write end: drop ours, and move output as it comes."""
        self._close_writer()
        self._loop = asyncio.get_running_loop()
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
        self._draining = True
        if self._cutting is not None:
            await self._cutting
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._unlisten()
        budget = self.limit + self.slack
        while self._pipe >= 0 and budget > 0:
            before = self._end
            ended = self._move(budget)
            budget -= self._end - before
            if self._over():
                await asyncio.to_thread(self._cut)
            if ended or self._end == before:
                break
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

    # --- moving and cutting ---

    def _at(self, position: int) -> int:
        """Where an output position is in the file."""
        return self._head + position - self._base

    def _over(self) -> bool:
        return self._end - self._base > self.limit + self.slack

    def _listen(self) -> None:
        if self._loop is not None and not (self._reading or self._draining) and self._pipe >= 0:
            self._loop.add_reader(self._pipe, self._pump)
            self._reading = True

    def _unlisten(self) -> None:
        if self._loop is not None and self._reading:
            self._loop.remove_reader(self._pipe)
            self._reading = False

    def _pump(self) -> None:
        """The pipe is readable: move what it holds; at its end, stop listening; over
        the bound, stop until the file is cut."""
        if self._move(MOVE_BYTES):
            self._unlisten()
        elif self._over():
            self._unlisten()
            self._cutting = asyncio.get_running_loop().create_task(self._cut_then_listen())

    def _move(self, most: int) -> bool:
        """Splice up to ``most`` bytes from the pipe into the file; whether it ended."""
        moved = 0
        while moved < most:
            try:
                step = os.splice(self._pipe, self._fd, most - moved, offset_dst=self._at(self._end))
            except BlockingIOError:
                return False
            if step == 0:
                return True
            self._end += step
            moved += step
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
        if wait > 0 and self._loop is not None:
            self._resume = self._loop.call_later(wait, self._listen_again)
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
        """A cut that failed (a full disk) keeps nothing but the marker: the bound holds."""
        log.warning(
            "the log %s could not be cut (%s): its output so far is dropped", self.path, exc
        )
        marker = dropped_marker(self._end, self.limit).encode()
        with self._lock:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, marker, 0)
            self._head, self._base = len(marker), self._end

    def _close_writer(self) -> None:
        if self.writer >= 0:
            os.close(self.writer)
            self.writer = -1


def _copy(src: int, at: int, dst: int, to: int, count: int) -> None:
    """``count`` bytes from ``src`` at ``at`` into ``dst`` at ``to``, by the kernel."""
    done = 0
    while done < count:
        step = os.copy_file_range(src, dst, count - done, at + done, to + done)
        if step == 0:
            raise OSError(f"the log ended {count - done} bytes early")
        done += step
