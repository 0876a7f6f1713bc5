"""Shipping running attempts' logs to core while they run (docs/logs.md).

One asyncio task per agent, apart from claiming and reporting: every
``CAIRN_WORKER_LOG_INTERVAL_S`` it reads what each registered attempt's log file gained and
sends it, for all of them at once, in one request (nothing when nothing was written).
Each attempt ships at most ``CAIRN_WORKER_LOG_RATE_KIB_S``, in chunks of at most 64 KiB
that end at a line's end where they can; a request carries at most 1 MiB. Core's answer
says, per chunk, how far its copy of the file goes: a failed request is simply sent again
from there (core keeps each offset once), after a backoff, so nothing is held in memory
but the request in flight. When the unsent part of a file outgrows
``CAIRN_WORKER_LOG_BACKLOG_MB``, or its file no longer holds it (``logfile``: the file
keeps the last ``CAIRN_LOG_MAX_BYTES``), its middle is skipped (core marks the gap). A chunk core
refuses (409: the attempt is no longer this worker's) ends that attempt's shipping.

The chunks are the log: at an attempt's end ``finish`` sends the rest at once, not rate
limited, before the agent reports, so a follower sees every line before the end; it
waits at most ``CAIRN_WORKER_LOG_FLUSH_S`` for that. An attempt that wrote nothing more
costs no request at all. If core is slower than that, the report says how long the
output was (``Report.log_bytes``) and the rest goes on after it, for at most
``CAIRN_WORKER_LOG_TAIL_S`` more (core takes it for ``CAIRN_LOG_LATE_S`` after the
report, and holds the log's end and its archiving until then); past that it is given up
with a warning naming the bytes core never got. The file stays open until then
(``release``): the bytes left are bounded as any backlog is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from libs.common import waits
from libs.common.client import CoreClient
from libs.common.errors import CairnError
from libs.common.models import MAX_LOG_BATCH, MAX_LOG_CHUNK, LogAck, LogBatch, LogChunk
from services.worker.settings import WorkerSettings

log = logging.getLogger("cairn.worker.logs")

REQUEST_BYTES = 1024 * 1024
#: the most logs whose end goes on after their report (``finish``), each keeping its file
#: open until then: past it, an end core was too slow for is given up at the report
MAX_LATE_LOGS = 128
_FINISHING_CHUNKS = 16
_BACKOFF_MAX_S = 10.0


class LogSource(Protocol):
    """An attempt's output as the shipper reads it (``logfile.AttemptLog``): positions
    are of the output, whatever its file on disk kept."""

    def size(self) -> int:
        """How many bytes of output there were so far."""

    def read(self, offset: int, most: int) -> tuple[int, bytes]:
        """Up to ``most`` bytes from ``offset``, or from the first still kept; (their
        start, the bytes). Called in a thread."""


@dataclass
class _Log:
    worker_id: int
    source: LogSource
    offset: int = 0  # how far into the file core's copy goes
    allowance: float = 0.0  # bytes it may send now (a token bucket)
    held: bool = False  # a partial line was kept back last round
    finishing: bool = False
    late: bool = False  # reported while its end was still on its way
    deadline: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    close: Callable[[], None] | None = None  # the agent is done with the file


@dataclass(frozen=True)
class _Read:
    attempt_id: int
    size: int
    start: int
    data: bytes


class LogShipper:
    """Ships the logs of the attempts registered with it; see the module's docstring."""

    def __init__(self, client: CoreClient, settings: WorkerSettings) -> None:
        self.client = client
        self.interval_s = settings.worker_log_interval_s
        self.rate = settings.worker_log_rate_kib_s * 1024
        self.burst = max(self.rate * self.interval_s, MAX_LOG_CHUNK)
        self.backlog = settings.worker_log_backlog_mb * 2**20
        self.flush_s = settings.worker_log_flush_s
        self.tail_s = settings.worker_log_tail_s
        self._logs: dict[int, _Log] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._refilled = time.monotonic()

    def register(self, worker_id: int, attempt_id: int, source: LogSource) -> None:
        """Start shipping the attempt's log."""
        self._logs[attempt_id] = _Log(worker_id, source, allowance=self.burst)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="cairn-log-shipper")

    async def finish(self, attempt_id: int) -> int | None:
        """The attempt's process has ended: send the rest of its log, waiting at most
        ``flush_s``. None once core holds it all (or shipping is off, or core refused
        it); else how long its output is, for the report: the rest goes on after it, for
        at most ``tail_s`` more."""
        entry = self._logs.get(attempt_id)
        if entry is None:
            return None
        size = entry.source.size()
        if self.flush_s <= 0 or size <= entry.offset:
            self._forget(attempt_id)
            return None
        entry.finishing, entry.deadline = True, time.monotonic() + self.flush_s + self.tail_s
        self._wake.set()
        await waits.woken(entry.done, self.flush_s)
        if entry.done.is_set():
            return None
        if self.tail_s <= 0:
            self._give_up(attempt_id, entry, f"in {self.flush_s:g} s after its end")
            return None
        if sum(e.late for e in self._logs.values()) >= MAX_LATE_LOGS:
            why = f"at its end: {MAX_LATE_LOGS} other logs' ends were already on their way"
            self._give_up(attempt_id, entry, why)
            return None
        entry.late = True
        log.info(
            "attempt %s: %d bytes of its log still on their way to core; reported, the rest"
            " goes on for at most %g s",
            attempt_id,
            size - entry.offset,
            self.tail_s,
        )
        return size

    def release(self, attempt_id: int, close: Callable[[], None]) -> None:
        """The agent is done with the attempt's file: ``close`` it once its log is
        shipped (or given up), at once if nothing of it is left to send."""
        entry = self._logs.get(attempt_id)
        if entry is None or not entry.late:
            self._forget(attempt_id)
            close()
            return
        entry.close = close

    def _forget(self, attempt_id: int) -> None:
        entry = self._logs.pop(attempt_id, None)
        if entry is None:
            return
        entry.done.set()
        if entry.close is not None:
            try:
                entry.close()
            except OSError as exc:
                log.warning("attempt %s's log file not closed: %s", attempt_id, exc)

    # --- the loop ---

    async def _run(self) -> None:
        delay = 0.0
        while self._logs:
            try:
                busy = await self._turn()
                delay = 0.0
            except (httpx.TransportError, CairnError) as exc:
                delay = min(max(delay * 2, self.interval_s), _BACKOFF_MAX_S)
                log.warning("logs not shipped (%s); again in %g s", exc, delay)
                self._give_up_late()
                busy = False
            except Exception:
                log.exception("the log shipper failed; going on")
                delay, busy = _BACKOFF_MAX_S, False
            if not busy:
                await self._pause(delay or self.interval_s)

    async def _pause(self, seconds: float) -> None:
        await waits.woken(self._wake, seconds)
        self._wake.clear()

    async def _turn(self) -> bool:
        """One request's worth; whether more is waiting to go at once (an end's rest)."""
        self._refill()
        wanted, left = self._wanted()
        if not wanted:
            self._settle()
            return False
        reads = await asyncio.to_thread(_read_all, wanted, self.backlog)
        chunks = self._chunks(reads)
        if chunks:
            worker_id = self._logs[chunks[0].attempt_id].worker_id
            acks = await self.client.ship_logs(worker_id, LogBatch(chunks=chunks))
            self._apply(acks)
        self._settle()
        finishing = any(e.finishing for e in self._logs.values())
        return bool(chunks) and (finishing or left)

    def _refill(self) -> None:
        now = time.monotonic()
        gained, self._refilled = self.rate * (now - self._refilled), now
        for entry in self._logs.values():
            entry.allowance = min(self.burst, entry.allowance + gained)

    def _wanted(self) -> tuple[list[tuple[int, LogSource, int, int]], bool]:
        """(attempt, log, from, at most how many bytes) for one request of one worker,
        and whether some were left for the next (a full request)."""
        wanted: list[tuple[int, LogSource, int, int]] = []
        room, chunks, worker, left = REQUEST_BYTES, MAX_LOG_BATCH, None, False
        for attempt_id, entry in sorted(self._logs.items(), key=lambda i: not i[1].finishing):
            # Room for what it has to send, not for its allowance: an attempt that wrote
            # little since takes little, and leaves the rest to the others.
            pending = entry.source.size() - entry.offset
            if pending <= 0:
                continue
            worker = entry.worker_id if worker is None else worker
            most = MAX_LOG_CHUNK * _FINISHING_CHUNKS if entry.finishing else int(entry.allowance)
            most = min(most, room, chunks * MAX_LOG_CHUNK, pending)
            if entry.worker_id != worker or most <= 0:
                left = left or entry.worker_id != worker or room <= 0 or chunks <= 0
                continue
            wanted.append((attempt_id, entry.source, entry.offset, most))
            room, chunks = room - most, chunks - -(-most // MAX_LOG_CHUNK)
        return wanted, left

    def _chunks(self, reads: list[_Read]) -> list[LogChunk]:
        chunks: list[LogChunk] = []
        for read in reads:
            entry = self._logs.get(read.attempt_id)
            if entry is None or not read.data:
                continue
            data = read.data
            if not entry.finishing:
                data = self._whole_lines(entry, data, read.start + len(data) == read.size)
            entry.allowance -= len(data)
            chunks += _split(read.attempt_id, read.start, data)
        return chunks

    @staticmethod
    def _whole_lines(entry: _Log, data: bytes, at_end: bool) -> bytes:
        """Up to the last line's end. A partial line goes as a whole chunk, or, at the
        file's end, once it has waited a round (a progress bar, a prompt); cut short by
        the rate, it waits for the allowance to grow."""
        cut = data.rfind(b"\n") + 1
        if cut:
            entry.held = False
            return data[:cut]
        if len(data) >= MAX_LOG_CHUNK or (at_end and entry.held):
            entry.held = False
            return data
        entry.held = at_end
        return b""

    def _apply(self, acks: list[LogAck]) -> None:
        for ack in acks:
            entry = self._logs.get(ack.attempt_id)
            if entry is None:
                continue
            if ack.status >= 400:
                log.warning("core refused attempt %s's log: %s", ack.attempt_id, ack.detail)
                self._forget(ack.attempt_id)
            else:
                entry.offset = max(entry.offset, ack.next_offset)

    def _settle(self) -> None:
        """Finishing attempts whose whole file core holds are done."""
        for attempt_id, entry in list(self._logs.items()):
            if entry.finishing and entry.source.size() <= entry.offset:
                if entry.late:
                    log.info("attempt %s: the end of its log reached core", attempt_id)
                self._forget(attempt_id)
        self._give_up_late()

    def _give_up_late(self) -> None:
        now = time.monotonic()
        for attempt_id, entry in list(self._logs.items()):
            if entry.finishing and now > entry.deadline:
                self._give_up(attempt_id, entry)

    def _give_up(self, attempt_id: int, entry: _Log, why: str = "") -> None:
        log.warning(
            "attempt %s: gave up on the end of its log: %d bytes did not reach core %s",
            attempt_id,
            max(0, entry.source.size() - entry.offset),
            why or f"in {self.flush_s + self.tail_s:g} s after its end",
        )
        self._forget(attempt_id)


def _read_all(wanted: list[tuple[int, LogSource, int, int]], backlog: int) -> list[_Read]:
    """Read what is wanted of each log (in a thread: file I/O)."""
    reads = []
    for attempt_id, source, offset, most in wanted:
        size = source.size()
        start = max(offset, size - backlog)  # too far behind: skip the middle
        if size <= start:
            continue
        try:
            start, data = source.read(start, min(most, size - start))
        except OSError:
            continue
        if data:
            reads.append(_Read(attempt_id, size, start, data))
    return reads


def _split(attempt_id: int, offset: int, data: bytes) -> list[LogChunk]:
    """Chunks of at most 64 KiB, each cut between characters where it can be."""
    chunks = []
    while data:
        piece = data[:MAX_LOG_CHUNK]
        if len(piece) < len(data):
            piece = piece[: _char_boundary(piece)] or piece
        text = piece.decode("utf-8", errors="replace")
        chunks.append(LogChunk(attempt_id=attempt_id, offset=offset, length=len(piece), text=text))
        offset, data = offset + len(piece), data[len(piece) :]
    return chunks


def _char_boundary(data: bytes) -> int:
    """The length of ``data`` without a character cut short at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if back < need else len(data)
    return len(data)
