"""Wake-ups for long polls: followers of the event feed and of logs, and waiting claims.

Whoever commits new events calls ``Notifier.announce()`` after the commit: it wakes this
process's waiters at once and sends one ``pg_notify`` for the other replicas, coalesced
over a few milliseconds on a connection of its own. NOTIFY is deliberately kept out of
the writing transactions: PostgreSQL serialises the commits of transactions that notify
on one lock, which capped submits. One LISTEN connection per process receives the
others' announcements. Its own events, which PostgreSQL delivers to every listener, are
known by the sending backend's pid and dropped: this process woke its waiters when it
announced, and the echo woke each waiting claim a second time, a lease attempt for
nothing per submission. A waiter reads, then waits: it takes ``mark()`` before its read
and waits ``since`` it, so an announcement between the read and the wait (which the
echo used to cover, 5 ms late) returns at once. Lost wake-ups cost latency only:
waiters also poll.

A replica with no other replica to tell tells no one: its notes would come back only as
its own echo, which PostgreSQL sends its listener at every commit (a signal, a read of
the queue, a message, and here a note to drop: about 0.1 ms of CPU a submission between
the two). Each listener names itself (``LISTENER_NAME``), says hello on ``PEERS_CHANNEL``
when it starts listening, and counts the other listeners of its database; a replica is
``alone`` while that count was 0 and nothing has been heard from another since. A hello,
or any note from another backend, ends it at once; while not alone, the count is taken
again every ``peers_check_s`` (a replica whose peers left goes back to telling no one).
What a replica did not tell in the moment before a newcomer's hello reached it is a lost
wake-up: the newcomer looks at everything when it starts listening, and sweeps.

The same two connections carry due hints (channel ``cairn_due``, payload UNIX seconds):
whoever stores a delayed task or sets a backoff calls ``announce_due(run_at)``, and every
replica's promoter (``loops.Promoter``) hears of it, so its timer can be set on the
earliest due instant.

And log bells (channel ``cairn_logs``, payload attempt ids): whoever stores chunks of a
log, or ends an attempt, rings its bell with ``announce_log``; followers of that log
(``wait_log``) wake, and no one else does.

Waiting claims are not followers: a worker's claim that found nothing waits in this
process's ``Line`` (longest waiting first) and is woken only by work it may be able to
use. Whoever makes work claimable says how much, and where (``Work``: tasks per queue,
tasks of queues it does not know, workers by id), with ``announce(work)``; each replica
wakes at most that many of its waiting claims, the count travelling in the NOTIFY payload
(channel ``cairn_work``). A woken claim that leased and may have left work behind passes
the wake on to one more (``Line.pass_on``); one woken for nothing goes back to its place.
No waiting claim re-polls on its own: each replica sweeps its line once a ``sweep_s``
(the oldest waiter of each queue looks), which bounds what a lost wake-up costs, at a
price that does not grow with the fleet (docs/architecture.md, "Wake-ups").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from libs.common import waits
from libs.common.database import keepalive
from libs.common.settings import libpq_url
from services.core.domain.placement import ZERO, Amount
from services.core.domain.selectors import satisfies

log = logging.getLogger("cairn.core.feed")

CHANNEL = "cairn_events"
DUE_CHANNEL = "cairn_due"
LOG_CHANNEL = "cairn_logs"
WORK_CHANNEL = "cairn_work"
PEERS_CHANNEL = "cairn_peers"
#: the ``application_name`` of every replica's listening session: how replicas count
#: each other (``pg_stat_activity`` shows it to every role)
LISTENER_NAME = "cairn-core-listener"
#: how often a replica that has peers counts them again
PEERS_CHECK_S = 10.0
_PAYLOAD_MAX = 7900  # under PostgreSQL's 8000-byte NOTIFY payload
COALESCE_S = 0.005
#: a listener's or announcer's session that lasted this long was a success: the pause
#: before the next starts again at its shortest (``Notifier._connected``)
SETTLED_S = 5.0
#: at most one line this often says how many notes could not be read (``Notifier._lost``)
UNREAD_LOG_S = 60.0

# The other replicas' listening sessions (``Notifier.alone``), and the hello a new one sends.
_PEERS = """SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = %(name)s AND pid <> pg_backend_pid()"""
_HELLO = f"SELECT pg_notify('{PEERS_CHANNEL}', '')"

Session = Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]

#: the most queues or workers named in one ``Work`` payload; past it, a sweep stands in
_WORK_NAMES_MAX = 200


@dataclass(frozen=True)
class Work:
    """What an announcement offers waiting claims: tasks that became claimable per queue,
    tasks claimable in queues not known (``any``), workers it concerns by id (drained,
    or work reserved for them), and whether every queue's longest waiting claim should
    look (``sweep``: a due instant came, or a count was lost)."""

    queues: Mapping[str, int] = field(default_factory=dict)
    any: int = 0
    workers: frozenset[int] = frozenset()
    sweep: bool = False
    #: tasks that require labels, one (queue, compiled required selectors) each
    #: (``domain.selectors.compile_required``): each wakes a claim whose worker matches
    placed: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    #: room a worker's own reports freed on it (CPU and memory its charges held), by
    #: worker id: its waiting claim looks again, its room grown by it (``Waiter.freed``)
    freed: Mapping[int, Amount] = field(default_factory=dict)
    #: workers whose reports ended attempts (room freed on them): each one's waiting claim
    #: looks again if it may have been short of room (``Line.may_grow``)
    ended: frozenset[int] = frozenset()

    @classmethod
    def of_queues(cls, queues: Iterable[str]) -> Work:
        return cls(queues=dict(Counter(queues)))

    def __bool__(self) -> bool:
        return bool(
            self.queues
            or self.any
            or self.workers
            or self.sweep
            or self.placed
            or self.freed
            or self.ended
        )

    def __add__(self, other: Work) -> Work:
        queues = dict(Counter(self.queues) + Counter(other.queues))
        return Work(
            queues,
            self.any + other.any,
            self.workers | other.workers,
            self.sweep or other.sweep,
            self.placed + other.placed,
            {
                w: self.freed.get(w, ZERO) + other.freed.get(w, ZERO)
                for w in {*self.freed, *other.freed}
            },
            self.ended | other.ended,
        )

    def dump(self) -> str:
        """The NOTIFY payload; too many names become a sweep with the total count (room
        freed on workers stays, a sweep cannot stand in for it: the first
        ``_WORK_NAMES_MAX`` workers')."""
        names = len(self.queues) + len(self.workers) + len(self.placed) + len(self.freed)
        if names + len(self.ended) > _WORK_NAMES_MAX:
            total = self.any + sum(self.queues.values()) + len(self.placed)
            freed = dict(sorted(self.freed.items())[:_WORK_NAMES_MAX])
            return Work(any=total, sweep=True, freed=freed).dump()
        body: dict[str, Any] = {}
        if self.queues:
            body["q"] = dict(self.queues)
        if self.any:
            body["n"] = self.any
        if self.workers:
            body["w"] = sorted(self.workers)
        if self.ended:
            body["e"] = sorted(self.ended)
        if self.sweep:
            body["s"] = 1
        if self.placed:
            body["p"] = [[queue, dict(rule)] for queue, rule in self.placed]
        if self.freed:
            # rounded down to 1/1000 (a claim grows a little less at worst), to keep
            # ``_WORK_NAMES_MAX`` of them short of the payload's bound
            body["f"] = {
                str(w): [_down(a.cpu), _down(a.memory_mb)] for w, a in sorted(self.freed.items())
            }
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def load(cls, payload: str) -> Work:
        """A payload back; one that cannot be read is a sweep (a count was lost). Any
        session of the database may NOTIFY this channel: whatever its payload (a count of
        1e400, arrays nested past the JSON reader's depth), it is read or swept."""
        try:
            body = json.loads(payload)
            return cls(
                queues={str(q): int(n) for q, n in body.get("q", {}).items()},
                any=int(body.get("n", 0)),
                workers=frozenset(int(w) for w in body.get("w", ())),
                sweep=bool(body.get("s", 0)),
                placed=tuple((str(q), dict(rule)) for q, rule in body.get("p", ())),
                freed={
                    int(w): Amount(float(cpu), float(memory_mb))
                    for w, (cpu, memory_mb) in body.get("f", {}).items()
                },
                ended=frozenset(int(w) for w in body.get("e", ())),
            )
        except (ValueError, TypeError, AttributeError, ArithmeticError, RecursionError):
            return cls(sweep=True)


def _down(value: float) -> float:
    return math.floor(value * 1000) / 1000


class Bell:
    """``asyncio.Event``'s ``set``, ``clear`` and ``is_set`` for one waiter, whose wait
    with a timeout is one future: ``asyncio.wait_for`` runs the event's wait in a task of
    its own, a pass of the loop more for every claim woken."""

    __slots__ = ("_future", "_rung")

    def __init__(self) -> None:
        self._rung = False
        self._future: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._rung

    def set(self) -> None:
        self._rung = True
        _settle(self._future)

    def clear(self) -> None:
        self._rung = False

    async def wait_for(self, timeout: float) -> bool:
        """Until rung (True) or ``timeout`` seconds (False)."""
        if self._rung:
            return True
        loop = asyncio.get_running_loop()
        future = self._future = loop.create_future()
        timer = loop.call_later(timeout, _settle, future)
        try:
            await future
        finally:
            timer.cancel()
            if self._future is future:
                self._future = None
        return self._rung


def _settle(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class Waiter:
    """One waiting claim: its worker, its queues (None until its worker's row is read:
    then it serves every queue), the event that wakes it, and the room its worker's own
    reports freed while it waited (``freed``: the agent measured the claim's room before
    those attempts ended), and whether its last look may have been short of room
    (``short``: it had none, or work of its queues waited that it did not take; True
    until it has looked, and while it looks) as of the line's count of such looks
    (``seen``: ``Line.may_grow``)."""

    __slots__ = ("event", "facts", "freed", "queues", "seen", "short", "worker")

    def __init__(self, worker: int, queues: frozenset[str] | None) -> None:
        self.worker = worker
        self.queues = queues
        #: its worker's labels as facts (``domain.selectors.facts``); None until read
        self.facts: frozenset[str] | None = None
        self.event = Bell()
        self.freed = ZERO
        self.short = True
        self.seen = 0

    def serves(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues

    def can_take(self, queue: str, rule: Mapping[str, Any]) -> bool:
        """Whether its worker serves ``queue`` and matches a task's required selectors
        (compiled); a worker not read yet may."""
        return self.serves(queue) and (self.facts is None or satisfies(rule, self.facts))

    def shares(self, other: Waiter) -> bool:
        return (
            self.queues is None or other.queues is None or not self.queues.isdisjoint(other.queues)
        )

    @property
    def woken(self) -> bool:
        return self.event.is_set()

    async def wait(self, timeout: float) -> bool:
        """Until woken (True) or ``timeout`` seconds (False)."""
        return await self.event.wait_for(timeout)


class Line:
    """This process's waiting claims, longest waiting first. A claim joins before its
    first look (so work announced during that look wakes it), rests after a look that
    found nothing (keeping its place) and leaves when its turn answers."""

    def __init__(self) -> None:
        self._waiting: dict[Waiter, None] = {}  # insertion order: waiting order
        #: looks on this line that may have been short of room (``looked``)
        self.shorts = 0
        #: the process is stopping: waiting claims answer now (nothing leased)
        self.closed = False

    def close(self) -> None:
        """The server stops: every waiting claim answers at once, and none waits again."""
        self.closed = True
        self.wake_all()

    def __len__(self) -> int:
        return len(self._waiting)

    def join(self, worker: int, queues: Iterable[str] | None = None) -> Waiter:
        waiter = Waiter(worker, None if queues is None else frozenset(queues))
        self._waiting[waiter] = None
        return waiter

    def rest(self, waiter: Waiter) -> None:
        """About to look again: later work wakes it anew."""
        waiter.event.clear()
        waiter.short = True  # until its look says

    def looked(self, waiter: Waiter, short: bool) -> None:
        """Its look leased nothing; ``short``: it may have been for want of room (it had
        none, or work of its queues waited)."""
        if short:
            self.shorts += 1
        waiter.short, waiter.seen = short, self.shorts

    def may_grow(self, waiter: Waiter) -> bool:
        """Whether room freed on its worker may let it lease: its last look may have been
        short of room, or another look here was since (work waits that some claim did
        not take, and this one has not looked at it). A claim that last found nothing
        waiting at all has nothing more to find in a larger room: the work that comes
        next is announced and wakes it."""
        return waiter.short or waiter.seen != self.shorts

    def back(self, waiter: Waiter) -> None:
        """It looked and found nothing it could take: to the back of the line, so that the
        next wake-up or sweep of its queues reaches the others first (one of them may
        match work it cannot: placement by label)."""
        if waiter in self._waiting:
            del self._waiting[waiter]
            self._waiting[waiter] = None

    def leave(self, waiter: Waiter, *, used: bool = True) -> None:
        """The claim answers. A wake-up it did not use (it leased, or went, before it
        could look) goes to the next waiter of its queues."""
        self._waiting.pop(waiter, None)
        if waiter.woken and not used:
            self.pass_on(waiter)

    def pass_on(self, waiter: Waiter) -> int:
        """Wake one more waiter sharing a queue with ``waiter`` (work may be left)."""
        return self._wake_first(1, waiter.shares)

    def wake(self, work: Work) -> int:
        """Wake at most as many waiters as ``work`` can use; how many were woken."""
        woken = 0
        if work.workers:
            woken += self._wake_first(len(self._waiting), lambda w: w.worker in work.workers)
        woken += self._grow(work)
        for queue, n in work.queues.items():
            woken += self._wake_first(n, lambda w, q=queue: w.serves(q))  # type: ignore[misc]
        for queue, rule in work.placed:
            woken += self._wake_first(1, lambda w, q=queue, r=rule: w.can_take(q, r))  # type: ignore[misc]
        if work.any:
            woken += self._wake_first(work.any, lambda w: True)
        if work.sweep:
            seen: set[str] = set()
            for waiter in self._idle():
                if waiter.queues is None or not waiter.queues <= seen:
                    seen |= waiter.queues or set()
                    woken += self._set(waiter)
        return woken

    def _grow(self, work: Work) -> int:
        """Room freed on workers: added to their claims' (``freed``), and each claim
        that may lease more in it looks again (``may_grow``)."""
        if not work.freed and not work.ended:
            return 0
        woken = 0
        for waiter in list(self._waiting):
            if waiter.worker in work.freed:
                waiter.freed += work.freed[waiter.worker]
            grown = waiter.worker in work.freed or waiter.worker in work.ended
            if grown and not waiter.woken and self.may_grow(waiter):
                woken += self._set(waiter)
        return woken

    def wake_all(self) -> int:
        return self._wake_first(len(self._waiting), lambda w: True)

    def _idle(self) -> Iterator[Waiter]:
        return (w for w in list(self._waiting) if not w.woken)

    def _wake_first(self, n: int, fits: Callable[[Waiter], bool]) -> int:
        woken = 0
        for waiter in self._idle():
            if woken >= n:
                break
            if fits(waiter):
                woken += self._set(waiter)
        return woken

    def _set(self, waiter: Waiter) -> int:
        waiter.event.set()
        return 1


def notes_of(work: Work) -> list[tuple[str, str]]:
    """The notes a transaction that commits new events, and ``work`` that became
    claimable, sends the other replicas itself: (channel, payload) pairs."""
    return [(CHANNEL, ""), (WORK_CHANNEL, work.dump())] if work else [(CHANNEL, "")]


class Notifier:
    def __init__(self, database_url: str) -> None:
        self._url = libpq_url(database_url)
        self._changed = asyncio.Event()
        self._outgoing = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._due_out: float | None = None
        self._events_out = False
        self._work_out = Work()
        self._logs_out: set[int] = set()
        self.line = Line()
        self._log_waiters: dict[int, tuple[asyncio.Event, list[int]]] = {}
        self._sender_pid: int | None = None  # the backend our announcements come from
        #: backends that tell the other replicas from their own writing transactions
        #: (the group commit's, ``ops.groupcommit``): their notes are ours too
        self._telling_pids: set[int] = set()
        self.on_due: Callable[[float], None] | None = None
        #: no other replica listens: nothing is sent to anyone (until known, it tells)
        self.alone = False
        self.peers_check_s = PEERS_CHECK_S
        self._listener_pid: int | None = None
        self._uncounted = False  # the last count failed (logged once)
        self._unread = 0  # notes that could not be read since the last line said so
        self._unread_said = -math.inf

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._listen(), name="cairn-listen"),
            asyncio.create_task(self._send(), name="cairn-notify"),
        ]

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """Its listener and its sender, for readiness."""
        return list(self._tasks)

    async def stop(self) -> None:
        await waits.stop(*self._tasks)

    def announce(self, work: Work | None = None, *, told: bool = False) -> None:
        """New events are committed: wake followers here, and tell the other replicas;
        with ``work``, what became claimable: wake as many waiting claims as it can use
        here, and as many on each other replica. ``told``: the writing transaction told
        the other replicas itself (``notes_of``), so only this one's are woken."""
        self._wake()
        if work:
            self.line.wake(work)
        if told or self.alone:
            return
        self._events_out = True
        if work:
            self._work_out = self._work_out + work
        self._outgoing.set()

    def telling(self, pid: int, *, gone: bool = False) -> None:
        """Backend ``pid`` sends this process's notes from its own transactions (or no
        longer does, ``gone``): their echo is not a wake-up here."""
        if gone:
            self._telling_pids.discard(pid)
        else:
            self._telling_pids.add(pid)

    def sweep(self) -> int:
        """This replica's own floor under lost wake-ups: the longest waiting claim of each
        queue looks. Not sent to the other replicas (each sweeps its own line)."""
        return self.line.wake(Work(sweep=True))

    def announce_log(self, attempt_ids: Iterable[int]) -> None:
        """These attempts' logs grew (or the attempts ended): wake their followers here
        and on the other replicas."""
        ids = set(attempt_ids)
        self._ring(ids)
        if self.alone:
            return
        self._logs_out |= ids
        self._outgoing.set()

    async def wait_log(self, attempt_id: int, timeout: float) -> None:
        """Return when the attempt's log bell rings, or after ``timeout`` seconds."""
        entry = self._log_waiters.setdefault(attempt_id, (asyncio.Event(), [0]))
        entry[1][0] += 1
        try:
            await waits.woken(entry[0], timeout)
        finally:
            entry[1][0] -= 1
            if not entry[1][0] and self._log_waiters.get(attempt_id) is entry:
                del self._log_waiters[attempt_id]

    def _ring(self, attempt_ids: Iterable[int]) -> None:
        for attempt_id in attempt_ids:
            entry = self._log_waiters.pop(attempt_id, None)
            if entry is not None:
                entry[0].set()

    def announce_due(self, at: datetime) -> None:
        """A delayed task due at ``at`` is committed: hint this process's promoter, and
        the other replicas' (the earliest of the hints since the last send goes out)."""
        when = at.timestamp()
        if self.on_due is not None:
            self.on_due(when)
        if self.alone:
            return
        if self._due_out is None or when < self._due_out:
            self._due_out = when
        self._outgoing.set()

    def mark(self) -> asyncio.Event:
        """A token for "what is announced from now on": take it before reading, and
        ``wait(since=token)`` returns at once if something was announced after it."""
        return self._changed

    async def wait(self, timeout: float, since: asyncio.Event | None = None) -> None:
        """Return when an event is announced (after ``since``, a ``mark()``; else from
        now on), or after ``timeout`` seconds."""
        event = self._changed if since is None else since
        if event.is_set():
            return
        await waits.woken(event, timeout)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _connected(self, name: str, body: Session, **args: Any) -> None:
        """Run ``body`` on a session of its own, for good: whatever ends it (the server
        lost, a statement refused, a bug) is logged and ``body`` runs again on a new
        session, after a pause that doubles from 0.1 s to 5 s while sessions fail, and
        starts again from 0.1 s after one that lasted ``SETTLED_S``: a body that fails as
        soon as it is connected is not connected again ten times a second."""
        delay = 0.1
        while True:
            began = time.monotonic()
            try:
                # A dead primary noticed in seconds (``database.keepalive``), not hours.
                async with await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True, **keepalive(self._url), **args
                ) as conn:
                    await body(conn)
            except Exception as exc:
                if time.monotonic() - began >= SETTLED_S:
                    delay = 0.1
                if isinstance(exc, psycopg.Error):
                    log.warning("%s lost its connection (%s); again in %.1f s", name, exc, delay)
                else:
                    log.exception("%s failed; again in %.1f s", name, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _listen(self) -> None:
        async def body(conn: psycopg.AsyncConnection[Any]) -> None:
            self._listener_pid = conn.info.backend_pid
            try:
                for channel in (CHANNEL, DUE_CHANNEL, LOG_CHANNEL, WORK_CHANNEL, PEERS_CHANNEL):
                    await conn.execute(f"LISTEN {channel}")
                # Whatever was announced while no one listened is lost: everyone looks again.
                self._wake()
                self._ring(list(self._log_waiters))
                self.line.wake_all()
                await self._count_peers(conn, hello=True)
                while True:
                    # Never left early: psycopg drops the rest of a packet's notes when
                    # its generator is closed (a note from another session ends being
                    # alone, and the due hints after it in the same packet were lost).
                    # A window ends every peers_check_s, alone or not.
                    async for note in conn.notifies(timeout=self.peers_check_s):
                        self._hear(note)
                    if not self.alone:  # notes meanwhile wait in order
                        await self._count_peers(conn)
            finally:
                self.alone = False  # not listening: tell, until it counts again
                self._listener_pid = None

        await self._connected("event listener", body, application_name=LISTENER_NAME)

    async def _count_peers(self, conn: psycopg.AsyncConnection[Any], hello: bool = False) -> None:
        """Count the other replicas' listeners (``alone`` if none); with ``hello`` first
        tell them this one listens."""
        if hello:
            await conn.execute(_HELLO)
        try:
            row = await (await conn.execute(_PEERS, {"name": LISTENER_NAME})).fetchone()
        except psycopg.Error as exc:  # a refused read: tell everyone, and go on listening
            if conn.broken or conn.closed:
                raise
            if not self._uncounted:
                log.warning("could not count the other replicas (%s); telling them", exc)
            self._uncounted, self.alone = True, False
            return
        self._uncounted = False
        self.alone = row is not None and row[0] == 0

    def _hear(self, note: psycopg.Notify) -> None:
        """Act on one note (one from another session ends being alone)."""
        ours = note.pid in (self._sender_pid, self._listener_pid) or note.pid in self._telling_pids
        self.alone = self.alone and ours
        if note.channel in (CHANNEL, WORK_CHANNEL, PEERS_CHANNEL) and ours:
            return  # our own: its waiters were woken when it was announced
        try:
            if note.channel == WORK_CHANNEL:
                self.line.wake(Work.load(note.payload))
            elif note.channel == LOG_CHANNEL:
                self._ring(int(i) for i in note.payload.split(",") if i.isdigit())
            elif note.channel == CHANNEL:
                self._wake()
            elif note.channel == DUE_CHANNEL and self.on_due is not None:
                with contextlib.suppress(ValueError):
                    self.on_due(float(note.payload))
        except Exception as exc:  # whatever the payload, the listener goes on
            self._lost(note, exc)

    def _lost(self, note: psycopg.Notify, exc: Exception) -> None:
        """A note that could not be read (any session of the database may NOTIFY these
        channels) is a lost wake-up: every waiter here looks again. Said in one line a
        ``UNREAD_LOG_S`` at most, without the payload (8000 bytes of anyone's)."""
        self._wake()
        self._ring(list(self._log_waiters))
        self.line.wake_all()
        self._unread += 1
        now = time.monotonic()
        if now - self._unread_said >= UNREAD_LOG_S:
            log.warning(
                "%d note(s) could not be read, the last on %s from backend %s (%s: %.200s);"
                " every waiter looks again",
                self._unread,
                note.channel,
                note.pid,
                type(exc).__name__,
                exc,
            )
            self._unread, self._unread_said = 0, now

    async def _send(self) -> None:
        async def body(conn: psycopg.AsyncConnection[Any]) -> None:
            self._sender_pid = conn.info.backend_pid
            try:
                while True:
                    await self._outgoing.wait()
                    self._outgoing.clear()
                    notes = self._notes()
                    if notes:
                        calls = ", ".join("pg_notify(%s, %s)" for _ in notes)
                        await conn.execute(f"SELECT {calls}", [v for note in notes for v in note])
                    await asyncio.sleep(COALESCE_S)
            finally:
                # Lost: another backend may be given its pid, and its notes are not ours.
                self._sender_pid = None

        await self._connected("event announcer", body)

    def _notes(self) -> list[tuple[str, str]]:
        """What to send now: (channel, payload) pairs; log ids in payloads under the limit."""
        due, self._due_out = self._due_out, None
        events, self._events_out = self._events_out, False
        work, self._work_out = self._work_out, Work()
        logs, self._logs_out = sorted(self._logs_out), set()
        notes = [(CHANNEL, "")] if events or due is not None else []
        if work:
            notes.append((WORK_CHANNEL, work.dump()))
        if due is not None:
            notes.append((DUE_CHANNEL, repr(due)))
        payload = ""
        for attempt_id in map(str, logs):
            if len(payload) + len(attempt_id) >= _PAYLOAD_MAX:
                notes.append((LOG_CHANNEL, payload))
                payload = ""
            payload = f"{payload},{attempt_id}" if payload else attempt_id
        if payload:
            notes.append((LOG_CHANNEL, payload))
        return notes
