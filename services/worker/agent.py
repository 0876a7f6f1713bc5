"""The worker agent (``cairn worker``): registers the host's capacity with core, claims
attempts that fit the room it has, runs each in its own process group and reports how it
ended. Its sidecar heartbeats. SIGTERM drains it: it tells core (which leases it nothing
more and answers its waiting claim), running attempts get the grace period, then the rest
are handed back without spending an attempt."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic_core import PydanticSerializationError

from libs.common import logs, procs, tracing, waits
from libs.common.client import CoreClient
from libs.common.errors import (
    CairnError,
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    Unauthorized,
    Unavailable,
)
from libs.common.models import (
    MAX_STARTS,
    MAX_TURN_CHECKPOINT_BYTES,
    MAX_TURN_ITEMS,
    MAX_WAIT_S,
    Assignment,
    AttemptReport,
    ClaimRequest,
    ProgressNote,
    Report,
    ReportVerdict,
    ServiceSpec,
    Turn,
    TurnAnswer,
    WorkerRegister,
    WorkerRegistered,
)
from libs.common.placement import SQUEEZED_CPU_SHARE
from libs.common.settings import load
from libs.common.states import Workers
from services.worker import hardening, outputs, pressure, probes, progress, state
from services.worker.artifacts import ArtifactCache, ArtifactError, hung_opens
from services.worker.devices import DevicePool, DevicesBusy, Held
from services.worker.executor import (
    AttemptResult,
    AttemptSpec,
    RunningAttempt,
    SourceUnanswered,
    SourceUnchecked,
    SpawnError,
)
from services.worker.firewall import Unenforceable
from services.worker.host import Host, HostError, Prepared
from services.worker.isolation import IsolationError
from services.worker.logship import LogShipper
from services.worker.replicas import Replicas, host_address
from services.worker.settings import WorkerSettings
from services.worker.spawner import hung_checkers, recount_hung
from services.worker.squeeze import squeeze
from services.worker.timings import Timings

log = logging.getLogger("cairn.worker")

#: the longest a claim waits at core for work (a long poll; core wakes it when work it
#: can use is announced, so an idle worker costs one turn per wait): the most core allows
CLAIM_WAIT_MAX_S = MAX_WAIT_S
#: the shortest (a worker whose heartbeat timeout is very short: tests)
CLAIM_WAIT_MIN_S = 1.0
#: how long before a held lease's start the agent asks core whether it still holds it
CONFIRM_BEFORE_S = 0.5
#: held leases are confirmed on this grid, each with all others in its slice, so a steady
#: stream of starts (each at its own instant: jitter) asks core at most 1/this a second
CONFIRM_GRID_S = 0.1


def confirm_at(start: float) -> float:
    """When to ask core about a lease held until ``start``: ``CONFIRM_BEFORE_S`` before
    it, rounded down to the grid, so that every lease whose start is in the same slice
    is asked about in one request."""
    return math.floor((start - CONFIRM_BEFORE_S) / CONFIRM_GRID_S) * CONFIRM_GRID_S


def _smoothed(old: float, new: float) -> float:
    """A moving average of recent times (``new`` alone while there is none yet)."""
    return new if not old else 0.8 * old + 0.2 * new


#: how long a report may wait for the claim in flight to come back so that the next
#: claim carries it, when the last claim was answered without waiting for work (work
#: arrives faster than turns go round: ``Agent._ride_s``): twice the round trip such
#: claims took of late, at most ``RIDE_MAX_S`` after the claim was sent. A claim that
#: takes longer, or one sent after a claim that waited (a chain's hop), leaves its
#: reports to the courier at once.
RIDE_MAX_S = 0.05
#: after a claim that waited for work leased attempts, the next claim waits for the
#: first of them to end (at most twice as long as that took of late: ``Agent._hold_claim``),
#: so that it carries its report: one turn a task (a chain's hop) instead of a claim
#: and a courier's report. Not when that took longer than this.
HOLD_MAX_S = 0.03
IO_THREADS = 16
REPORT_PATIENCE_S = 300.0
#: how many ended attempts an agent remembers, never to start them again
RAN_KEPT = 4096
DRAINING = Report(outcome="handed_back", error="the worker is draining")
#: the error of an attempt whose report could not be encoded as JSON (``Agent._report``)
UNENCODABLE = "the agent could not encode this attempt's report as JSON"
#: how long a draining agent waits for the answer to its claim waiting at core once it
#: told core it drains (core answers that claim at once: ``Turn.draining``); past it (a
#: core that cannot be reached), it gives the claim up, and what that carried goes again
DRAIN_ANSWER_S = 5.0


@dataclass
class Outgoing:
    """A report waiting for its turn, and the future its attempt waits on until core has
    answered it (or refused it, or patience ran out)."""

    report: AttemptReport
    done: asyncio.Future[None]
    give_up_at: float
    #: a turn carried it and its answer was never heard (lost on the way, or given up
    #: by a drain that core did not answer in time): core may have applied it
    unheard: bool = False


def _encodable(item: AttemptReport) -> bool:
    try:
        item.model_dump_json()
    except PydanticSerializationError as exc:
        log.error("attempt %s's report cannot be encoded: %s", item.attempt_id, exc)
        return False
    return True


def report_of(result: AttemptResult) -> Report | None:
    """What to tell core about a finished process; None when core already knows (the
    attempt was cancelled there)."""
    usage = {
        "exit_code": result.exit_code,
        "error": result.error,
        "peak_memory_mb": result.peak_memory_mb,
        "cpu_seconds": result.cpu_seconds,
        "log_tail": result.log_tail,
    }
    if result.outcome == "killed" and result.stopped == "cancelled":
        return None
    if result.outcome == "killed" and result.stopped == "terminated":
        return Report(outcome="handed_back", **usage)
    if result.outcome == "killed" and result.stopped == "preempted":
        return Report(outcome="preempted", **usage)
    if result.outcome == "killed":
        # A signal the worker did not send: its number lets the task's retry policy
        # decide (``RetryPolicy.never``/``always``).
        signum = result.signal if result.signal and 1 <= result.signal <= 64 else None
        return Report(outcome="crashed", signal=signum, **usage)
    return Report(outcome=result.outcome, **usage)


def claim_wait(interval_s: float, timeout_s: float) -> float:
    """How long a claim waits at core: long, so that an idle worker costs core little,
    but short enough that attempts leased at its end are still vouched for (``vouches``)
    by the turn's send time, and start without asking core."""
    margin = max(interval_s, timeout_s / 4)
    return max(CLAIM_WAIT_MIN_S, min(CLAIM_WAIT_MAX_S, (timeout_s - margin) / 2))


def vouches(
    heard_at: float, now: float, interval_s: float, timeout_s: float, lag_s: float = 0.0
) -> bool:
    """Whether the last turn core answered (sent at ``heard_at``, monotonic) vouches that
    core still holds this worker's leases, so an attempt may start without asking. That
    turn left the worker's liveness no older than ``lag_s`` before it was sent (a turn
    rewrites it only when older: ``turn_fresh_s``), and core declares a worker dead
    (re-placing its leases) only after ``timeout_s`` of silence since; the margin covers
    the start itself."""
    margin = max(interval_s, timeout_s / 4)
    return now - heard_at < timeout_s - margin - lag_s


def pulse_every(hang_s: float) -> float:
    """How often the agent's loop marks its pulse (``state.Board.pulse``) and sees whether
    a keep-alive turn is due: often against the hang bound the sidecar and core watch
    (4.7 s at the default), seldom enough that an idle agent's own wake-ups cost nothing."""
    return hang_s / 64


def keepalive_after(hang_s: float) -> float:
    """How long without a turn before the agent takes one with no claim (it is full, or
    draining), so core sees its turns: an eighth of the hang bound, above the longest
    claim wait at the default bound, so an idle agent's claims are its only turns."""
    return hang_s / 8


class Agent:
    def __init__(
        self, settings: WorkerSettings, client: CoreClient, token: str, host: Host
    ) -> None:
        self.settings = settings
        self.client = client
        self.token = token
        self.host = host
        self.cache = ArtifactCache(
            settings.home / "artifacts",
            sources=settings.sources,
            max_cache_bytes=settings.worker_cache_mb * 2**20,
            s3_own_buckets=settings.s3_own_buckets,
            open_timeout_s=settings.worker_source_timeout_s,
        )
        self.worker_id = 0
        self.lease = ""
        self.memory_floor_mb = settings.worker_min_available_mb or max(
            64, settings.worker_memory_mb // 20
        )
        self.folder = settings.home
        self.draining = asyncio.Event()
        self.running: dict[int, tuple[Assignment, RunningAttempt | None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.launching: list[Assignment] = []  # leased, their tasks made next (``_launch``)
        self.releasing: set[asyncio.Task[None]] = set()
        self.sidecar: subprocess.Popen[bytes] | None = None
        self.bridge: asyncio.Task[None] | None = None
        self.squeezed: set[int] = set()
        self.preempting: dict[int, asyncio.Task[AttemptResult]] = {}
        self.starting: set[int] = set()
        # Attempts leased ahead, waiting for their start_at: what wakes each (``_hold``).
        self.holding: dict[int, asyncio.Future[str]] = {}
        # Those whose start_at came in this loop iteration, asked about in one request.
        self.confirming: dict[int, asyncio.Future[str]] = {}
        self.confirm_soon: asyncio.Handle | None = None
        self.asking: set[asyncio.Task[None]] = set()
        self.board = state.Board.create()  # what the sidecar reads: ``_write_attempts``
        # Countable devices (``devices``): the pool, and the indexes each attempt holds.
        self.devices = DevicePool(settings.devices, settings.device_locks)
        self.held_devices: dict[int, Held] = {}
        self.publishing: asyncio.Handle | None = None  # a write of the board is due
        self.preempt_reasons: dict[int, str] = {}
        # The cgroup and uid of each attempt, as the board says them (``_write_attempts``).
        self.holdings = state.Holdings()
        self._beat = (60.0, 180.0)
        # core's hang bound and how far its stored liveness may lag a turn (registration)
        self.hang_s = 300.0
        self.fresh_s = 0.0
        self.turned_at = -math.inf  # when the last turn was sent (monotonic)
        self.keepalive: asyncio.Task[TurnAnswer | None] | None = None
        #: the turn that tells core this worker drains (``_tell_draining``), and until
        #: when (monotonic) the agent waits for the answers it brings
        self.telling: asyncio.Task[TurnAnswer | None] | None = None
        self.told_by = math.inf
        #: its spawn helpers asked how many of their checkers still hang (``_pulse``)
        self.recounting: asyncio.Task[None] | None = None
        self.dead = False
        self.logs = LogShipper(client, settings)
        self.timings = Timings(settings.worker_timings_file)
        # The turn: reports waiting to go (and in flight), starts to acknowledge, the
        # courier that sends reports alone while a claim waits for work, and when the
        # last turn that core heard was sent (it vouches for the leases: ``_vouched``).
        self.outbox: dict[int, Outgoing] = {}
        self.sending: dict[int, Outgoing] = {}
        self.started: set[int] = set()
        # The last claiming turn got no answer: core may have leased what this agent never
        # saw (``Turn.holding``), so the next claiming turn says what it holds. Only turns
        # that claim lease anything, and only one of them is ever in flight (``_work``):
        # no other turn's lease can be committed while core looks for lost ones.
        self.unanswered = False
        # Attempts this agent ran to their end (the last ``RAN_KEPT``): never started
        # again, whatever core hands out.
        self.ran: collections.OrderedDict[int, None] = collections.OrderedDict()
        # The highest attempt id a turn has handed this agent: written on the board with
        # the attempts it holds, so that a beat judges only the attempts this agent had
        # heard of when its list was read (``Heartbeat.seen``).
        self.seen = 0
        self.reported = asyncio.Event()
        self.claiming = False
        # When the claim in flight was sent (monotonic), whether the last claim was
        # answered without waiting in core's line, and the round trip of such claims of
        # late (a moving average: ``_ride_s``).
        self.claim_sent = -math.inf
        self.quick = False
        self.quick_rtt = 0.0
        # When a claim that waited was answered with leases (None: a report came since),
        # and how long after such an answer a report comes of late (``_hold_claim``).
        self.answered_at: float | None = None
        self.report_after = 0.0
        self.courier: asyncio.Task[None] | None = None
        self.heard_at = -math.inf
        self.working = False
        # Progress (docs/progress.md): each running attempt's files as last seen, what
        # they said that core has not heard yet, the one loop that looks at them, and
        # when progress last went to core (a turn of its own goes at most once per
        # ``worker_progress_interval_s``; it rides on every other turn).
        self.watches: dict[int, progress.Watch] = {}
        self.notes: dict[int, ProgressNote] = {}
        self.watcher: asyncio.Task[None] | None = None
        self.noted_at = -math.inf
        self.noting: asyncio.TimerHandle | None = None
        self.noter: asyncio.Task[TurnAnswer | None] | None = None
        self.stalling: set[asyncio.Task[AttemptResult]] = set()
        # Services (docs/services.md): what their probes say, on its way to core.
        self.replicas = Replicas(
            client, lambda: self.worker_id, host_address(settings.worker_address)
        )

    # --- lifecycle ---

    async def run(self) -> None:
        offer = self.settings.offer(socket.gethostname())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.draining.set)
        pulse = asyncio.create_task(self._pulse())
        try:
            if not await self._join(offer):
                return
            while True:
                await self._work()
                if not self.dead or self.draining.is_set():
                    break
                # Core re-placed this worker's attempts: stop them, then join afresh.
                log.warning("core declared worker %s dead; registering again", self.worker_id)
                await self._abandon()
                if not await self._join(offer):
                    return
            await self._drain()
        finally:
            pulse.cancel()
            await self._close()

    async def _close(self) -> None:
        """What the agent ends with, whatever ended it: its loops, the sidecar, its leave
        (when core had registered it), its cache, host and files."""
        for task in (self.keepalive, self.recounting):
            if task is not None:
                task.cancel()
        if self.releasing:
            await asyncio.wait(set(self.releasing), timeout=30)
        if self.noting is not None:
            self.noting.cancel()  # every attempt has ended: its notes went with its report
        await self._stop_sidecar()
        if self.worker_id:  # 0: never registered
            with contextlib.suppress(httpx.HTTPError, CairnError):
                await self.client.leave(self.worker_id)
        await self.cache.aclose()
        await self.host.close()
        self.timings.close()
        self.board.close()

    async def _join(self, offer: WorkerRegister) -> bool:
        """Register and start beating; False when told to stop before core answered."""
        registered = await self._register(offer)
        if registered is None:
            log.info("stopped before core registered this worker: nothing to drain")
            return False
        self.dead = False
        self.heard_at = -math.inf
        self.worker_id = registered.worker.id
        self.lease = registered.lease
        self.folder = self.settings.home / "workers" / str(self.worker_id)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._publish(now=True)  # the sidecar reads it as it starts
        self._beat = (registered.heartbeat_interval_s, registered.heartbeat_timeout_s)
        self.hang_s, self.fresh_s = registered.agent_hang_timeout_s, registered.turn_fresh_s
        self._launch_sidecar()
        logs.bind(worker_id=self.worker_id)
        log.info("worker %s registered for %s", self.worker_id, ",".join(offer.queues))
        return True

    async def _abandon(self) -> None:
        """Kill every attempt of a worker core declared dead (they run elsewhere now)."""
        self._launch()
        for attempt_id in list(self.holding):
            self._wake(attempt_id, "stop")
        for _, handle in list(self.running.values()):
            if handle is not None and not handle.done:
                handle.kill()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=30)
        await self._stop_sidecar()

    async def _pulse(self) -> None:
        """While the agent runs: mark on the board that its event loop turns (its sidecar
        kills its attempts when the marks stop: a hung agent), and take a turn with no
        claim when none went for a while (core buries a worker whose agent takes none)."""
        loop = asyncio.get_running_loop()
        while True:
            hung = (hung_opens(), hung_checkers())
            self.board.pulse(time.monotonic(), hung)
            if hung[1] and (self.recounting is None or self.recounting.done()):
                # A checker that ended is counted out at its helper's next request only.
                self.recounting = asyncio.create_task(recount_hung())
            quiet = loop.time() - self.turned_at > keepalive_after(self.hang_s)
            idle = self.keepalive is None or self.keepalive.done()
            if quiet and idle and self.worker_id and not self.dead:
                self.keepalive = asyncio.create_task(self._turn(None))
            await asyncio.sleep(pulse_every(self.hang_s))

    def _start_sidecar(self, interval_s: float, timeout_s: float) -> subprocess.Popen[bytes]:
        """The sidecar, given the token and the lease on its stdin (never in its argv or
        environment, which other processes may read)."""
        sidecar = subprocess.Popen(  # noqa: S603 - our own module, no shell
            [
                sys.executable,
                "-m",
                "services.worker.sidecar",
                str(self.folder),
                str(self.worker_id),
                str(interval_s),
                str(timeout_s),
                str(self.board.fd),
                f"--hang-s={self.hang_s}",
            ],
            stdin=subprocess.PIPE,
            pass_fds=(self.board.fd,),
        )
        assert sidecar.stdin is not None
        sidecar.stdin.write(json.dumps({"token": self.token, "lease": self.lease}).encode())
        sidecar.stdin.close()
        return sidecar

    async def _register(self, offer: WorkerRegister) -> WorkerRegistered | None:
        """Register, waiting for core if it is not up yet (it may be starting with us);
        None once SIGTERM or SIGINT came (``draining``): the agent holds nothing yet, and
        waiting on for a core that is down kept it from stopping until SIGKILL.
        ``Refused`` when core refuses the token or the offer: no retry makes it right."""
        delay = 0.2
        while not self.draining.is_set():
            try:
                return await self.client.register_worker(offer)
            except (httpx.TransportError, Unavailable) as exc:
                log.warning("core not reachable yet (%s); retrying", exc)
            except (Unauthorized, Forbidden, InvalidInput) as exc:
                raise Refused(
                    f"core refused to register this worker ({exc.status} {exc}): check"
                    " that CAIRN_TOKEN_FILE or CAIRN_TOKEN holds a worker token (cairn"
                    " token create NAME --role worker) and what CAIRN_WORKER_* offer"
                ) from None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.draining.wait(), delay)
            delay = min(delay * 2, 5.0)
        return None

    def _keep_sidecar(self) -> None:
        if self.sidecar is not None and self.sidecar.poll() is not None:
            log.warning("the sidecar exited (%s); starting it again", self.sidecar.returncode)
            self._launch_sidecar()

    def _launch_sidecar(self) -> None:
        """Start the sidecar, and beat in its place until it has beaten once."""
        (self.folder / state.ANSWER).unlink(missing_ok=True)
        self.sidecar = self._start_sidecar(*self._beat)
        if self.bridge is not None:
            self.bridge.cancel()
        self.bridge = asyncio.create_task(self._bridge(self.worker_id, self.folder))

    async def _bridge(self, worker_id: int, folder: Path) -> None:
        """Heartbeat for the worker while its sidecar starts: a fresh interpreter can take
        longer than the heartbeat timeout on a loaded host, and a worker silent that long
        is declared dead, and once registered again, dead again. Ends at the sidecar's
        first answer (or when the agent joins afresh)."""
        while self.worker_id == worker_id and not (folder / state.ANSWER).exists():
            alive, seen = sorted({*self.running, *self.starting}), self.seen
            try:
                answer = await self.client.heartbeat(worker_id, alive, seen=seen)
            except (httpx.TransportError, CairnError) as exc:
                log.warning("heartbeat while the sidecar starts failed: %s", exc)
            else:
                if self.worker_id == worker_id:
                    self._obey(answer.model_dump())
            await asyncio.sleep(self._beat[0])

    async def _stop_sidecar(self) -> None:
        if self.bridge is not None:
            self.bridge.cancel()
        if self.sidecar is not None and self.sidecar.poll() is None:
            self.sidecar.terminate()
            try:
                await asyncio.to_thread(self.sidecar.wait, 10)
            except subprocess.TimeoutExpired:
                log.error("the sidecar (pid %s) did not stop on SIGTERM: killed", self.sidecar.pid)
                self.sidecar.kill()
                await asyncio.to_thread(self.sidecar.wait)

    async def _work(self) -> None:
        self.working = True
        try:
            while not self.draining.is_set():
                self._keep_sidecar()
                self._obey_core()
                self.host.tidy()
                if self.draining.is_set() or self.dead:
                    break
                room = self._claim_room()
                if room is None and not self.outbox:
                    await self._pause(0.2, self.reported)
                    continue
                self.claiming = room is not None
                self.claim_sent = asyncio.get_running_loop().time()
                try:
                    answer = await self._turn_unless_draining(room)
                finally:
                    self.claiming = False
                if answer is None:
                    self.quick = False
                    await self._pause(1.0)
                    continue
                if room is not None:
                    self._answered(answer)
                if room is not None and not answer.attempts and not self.outbox:
                    await self._pause(0.2, self.reported)  # core answers at once: no lease
                self._start_all(answer.attempts)
                if room is not None and answer.attempts and answer.waited:
                    await self._hold_claim()
        finally:
            self.working = False
        self._kick()

    def _claim_room(self) -> ClaimRequest | None:
        cpu, memory_mb, slots = self._room()
        if slots <= 0 or cpu <= 0 or memory_mb <= 0:
            return None
        return ClaimRequest(
            cpu=cpu,
            memory_mb=memory_mb,
            max=min(slots, 64),
            wait=claim_wait(*self._beat),
            ahead_s=self.settings.worker_claim_ahead_s,
        )

    def _holding(self) -> list[int]:
        """Every attempt this agent holds: running, starting, or ended and not yet
        reported (``Turn.holding``)."""
        return sorted({*self.running, *self.starting, *self.outbox, *self.sending})

    def _start_all(self, leased: list[Assignment], now: bool = False) -> None:
        """Hold what a turn leased at once (its room is taken: the next claim is measured
        without it), and start preparing it on the loop's next pass: the main loop sends
        its next claim first, so that a claim waits at core while these are prepared
        (``now``: no claim goes next; they start first)."""
        fresh = []
        for assignment in leased:
            self.seen = max(self.seen, assignment.attempt_id)
            known = (self.running, self.starting, self.ran)
            if any(assignment.attempt_id in where for where in known):
                continue  # handed out again (``Turn.holding``), and already here or run
            self.running[assignment.attempt_id] = (assignment, None)
            fresh.append(assignment)
        if fresh:
            self._publish()
            if not self.launching and not now:
                asyncio.get_running_loop().call_soon(self._launch)
            self.launching.extend(fresh)
            if now:
                self._launch()

    def _launch(self) -> None:
        """Start preparing the attempts ``_start_all`` held (also at once before a drain
        or an abandon counts the attempts' tasks)."""
        leased, self.launching = self.launching, []
        for assignment in leased:
            task = asyncio.create_task(self._attempt(assignment))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    # --- the turn: one request carries the reports, the starts and the claim ---

    async def _turn_unless_draining(self, room: ClaimRequest | None) -> TurnAnswer | None:
        """A turn; when the agent starts draining while its claim waits at core, it tells
        core, which answers that claim at once with nothing leased: its answer is heard,
        and what the turn carried is settled by it. Given up only if that answer does
        not come within ``DRAIN_ANSWER_S`` (what it carried goes back)."""
        turn = asyncio.ensure_future(self._turn(room))
        drained = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait({turn, drained}, return_when=asyncio.FIRST_COMPLETED)
            if not turn.done():
                await self._answer_of(turn)
        finally:
            drained.cancel()
        if turn.done():
            return turn.result()
        log.warning("core did not answer the claim of a draining worker; giving it up")
        # Stopped through ``waits.stop``: an await of it under suppress(CancelledError)
        # swallowed a cancel of this task's own that came meanwhile (an agent's stop).
        await waits.stop(turn)
        if turn.cancelled() or turn.exception() is not None:
            return None
        return turn.result()

    async def _answer_of(self, turn: asyncio.Future[TurnAnswer | None]) -> None:
        """Wait for the answer of a claim waiting at core once the drain's turn told core
        (which answers it at once), until ``told_by``; no longer once the drain's turn
        failed: core did not hear it (one that predates ``Turn.draining`` refuses it, or
        none can be reached), and will not answer that claim before its wait is over."""
        telling = self._tell_draining()
        loop = asyncio.get_running_loop()
        first = asyncio.FIRST_COMPLETED
        await asyncio.wait(
            {turn, telling}, timeout=max(0.0, self.told_by - loop.time()), return_when=first
        )
        if not turn.done() and telling.done() and _heard_of(telling):
            await asyncio.wait({turn}, timeout=max(0.0, self.told_by - loop.time()))

    def _tell_draining(self) -> asyncio.Task[TurnAnswer | None]:
        """The turn (once) that tells core this worker drains, with the reports waiting:
        core leases it nothing more and answers its waiting claim (``Turn.draining``)."""
        if self.telling is None:
            self.told_by = asyncio.get_running_loop().time() + DRAIN_ANSWER_S
            self.telling = asyncio.create_task(self._turn(None, draining=True))
        return self.telling

    async def _turn(self, room: ClaimRequest | None, draining: bool = False) -> TurnAnswer | None:
        """One round trip; None when it failed (its reports and starts go again)."""
        items = self._take()
        notes = self._take_notes({o.report.attempt_id for o in items})
        # An attempt reported in this turn needs no acknowledgement of its start.
        started = sorted(self.started.difference(o.report.attempt_id for o in items))
        self.started.clear()
        body = Turn(
            reports=[o.report for o in items],
            started=started,
            claim=room,
            progress=notes,
            holding=self._holding() if room is not None and self.unanswered else None,
            draining=draining,
        )
        worker, sent, sent_wall = self.worker_id, asyncio.get_running_loop().time(), time.time()
        self.turned_at = sent
        try:
            answer = await self.client.turn(worker, body)
        except asyncio.CancelledError:
            self._put_back(items, unheard=True)
            self._put_back_notes(notes)
            self.started.update(started)
            raise
        except NotFound as exc:
            # Core knows no such worker (or lease): nothing of this turn can ever land.
            self._settle(items, {}, str(exc))
            return None
        except Exception as exc:
            # Core's answer not had: lost (transport), refused (a problem), or one this
            # agent cannot read (a proxy's page for core's answer, a bug: core may have
            # applied the turn); such an error ended the agent and lost what it carried
            if isinstance(exc, (httpx.TransportError, CairnError)):
                log.warning("turn failed: %s", exc)
            else:
                log.exception("turn failed: core's answer could not be read")
            self._put_back(items, unheard=not isinstance(exc, CairnError))
            self._put_back_notes(notes)
            self.started.update(started)
            self.unanswered = self.unanswered or room is not None
            if room is None:
                # A turn of its own (the drain's, a keep-alive, notes) took reports the
                # courier then found gone: they go again by it, not by the next such turn.
                self._deliver_soon()
            return None
        if room is not None:
            self.unanswered = False
        if worker == self.worker_id:
            self._heard(answer.state, sent)
        self.timings.leased([a.attempt_id for a in answer.attempts], sent_wall)
        if room is not None and answer.waited:
            # Work came while the claim waited (slower than turns go round): the next
            # claim is in no hurry (``_hold_claim`` holds it for a report), so these
            # start now, not a few loop passes later once the main loop has woken
            # (answered -> preparing p50 0.25 -> 0.06 ms at 50 tasks/s).
            self._start_all(answer.attempts, now=True)
        self._settle(items, {v.attempt_id: v for v in answer.reports if v.status != 200})
        for attempt_id, why in answer._unreadable:
            self._unreadable(attempt_id, why)
        return answer

    def _unreadable(self, attempt_id: int, why: str) -> None:
        """A leased attempt whose assignment this agent cannot read (core leases a row
        stored under looser bounds as it is) fails alone, nothing of it run; core's retry
        policy says what follows. Its ValidationError failed the whole turn's answer: it
        ended the agent, and the next agent leased it died of it in turn."""
        if attempt_id in self.outbox or attempt_id in self.running:
            return  # handed out again (``Turn.holding``): reported already, or running
        log.error("attempt %s: its assignment cannot be read (%s); failed", attempt_id, why)
        error = f"the worker could not read its assignment: {why}"[:4096]
        task = asyncio.create_task(self._report(attempt_id, Report(outcome="failed", error=error)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _heard(self, state: str, sent: float) -> None:
        if state in Workers.PRESENT:
            self.heard_at = max(self.heard_at, sent)
        if state == Workers.DEAD:
            self.dead = True
        elif state in (Workers.DRAINING, Workers.LEFT):
            self.draining.set()

    def _vouched(self) -> bool:
        interval, timeout = self._beat
        now = asyncio.get_running_loop().time()
        return vouches(self.heard_at, now, interval, min(timeout, self.hang_s), self.fresh_s)

    def _take(self) -> list[Outgoing]:
        now = asyncio.get_running_loop().time()
        taken: list[Outgoing] = []
        for attempt_id, out in list(self.outbox.items())[:MAX_TURN_ITEMS]:
            del self.outbox[attempt_id]
            if now > out.give_up_at:
                log.error("gave up reporting attempt %s", attempt_id)
                out.done.set_result(None)
                continue
            self.sending[attempt_id] = out
            taken.append(out)
        return taken

    def _take_notes(self, reported: set[int]) -> list[ProgressNote]:
        """The progress notes this turn carries: those of the attempts it reports (their
        last words, which core takes only before the report), then the others, within
        a turn's bounds."""
        if not self.notes:
            return []
        order = sorted(self.notes, key=lambda a: a not in reported)
        budget = MAX_TURN_CHECKPOINT_BYTES // 3 * 4
        taken: list[ProgressNote] = []
        for attempt_id in order[:MAX_TURN_ITEMS]:
            size = len(self.notes[attempt_id].checkpoint or "")
            if size > budget:
                continue
            budget -= size
            taken.append(self.notes.pop(attempt_id))
        self.noted_at = asyncio.get_running_loop().time()
        if self.notes:
            self._note_soon()
        return taken

    def _put_back_notes(self, notes: list[ProgressNote]) -> None:
        for note in notes:
            newer = self.notes.get(note.attempt_id)
            self.notes[note.attempt_id] = note if newer is None else progress.merge(note, newer)
        if notes:
            self._note_soon()

    def _note_soon(self) -> None:
        """Send what the attempts wrote in a turn of its own, unless another turn takes
        it first: at most once per ``worker_progress_interval_s``."""
        if self.noting is not None or not self.notes:
            return
        loop = asyncio.get_running_loop()
        due = self.noted_at + self.settings.worker_progress_interval_s
        self.noting = loop.call_at(max(loop.time(), due), self._send_notes)

    def _send_notes(self) -> None:
        self.noting = None
        if not self.notes:
            return
        if self.noter is not None and not self.noter.done():
            self.noted_at = asyncio.get_running_loop().time()
            self._note_soon()
            return
        self.noter = asyncio.create_task(self._turn(None))

    def _put_back(self, items: list[Outgoing], unheard: bool = False) -> None:
        for out in items:
            out.unheard = out.unheard or unheard
            self.sending.pop(out.report.attempt_id, None)
            self.outbox.setdefault(out.report.attempt_id, out)

    def _settle(
        self, items: list[Outgoing], refused: dict[int, ReportVerdict], why: str | None = None
    ) -> None:
        """Core answered these reports: applied, or refused (stale, gone), which is final."""
        for out in items:
            attempt_id = out.report.attempt_id
            self.sending.pop(attempt_id, None)
            verdict = refused.get(attempt_id)
            if verdict is not None and out.unheard and verdict.ended_as == out.report.outcome:
                # Sent again after a turn whose answer was not heard (lost on the way,
                # after core applied its reports): core ended the attempt as it says, by
                # this report.
                log.info(
                    "report of attempt %s was applied by an earlier turn whose answer was "
                    "not heard; core refuses it again, as it should (%s)",
                    attempt_id,
                    verdict.ended_as,
                )
            elif why is not None or verdict is not None:
                detail = why if verdict is None else verdict.detail
                log.warning("report of attempt %s refused: %s", attempt_id, detail)
            if not out.done.done():
                out.done.set_result(None)

    async def _hold_claim(self) -> None:
        """A claim that waited for work was answered with leases: work comes slower than
        turns go round, and its attempts may be short. Hold the next claim until a
        report is ready, so that it carries it, if reports came soon after such answers
        of late (``HOLD_MAX_S``); the claim goes anyway when that time is up."""
        loop = asyncio.get_running_loop()
        self.answered_at = loop.time()
        patience = 2 * self.report_after
        if self.outbox or not 0 < patience <= HOLD_MAX_S:
            return
        await self._pause(patience, self.reported)

    def _kick(self) -> None:
        """A report is waiting: the next turn takes it, or, while the main loop's claim
        waits for work (or after the loop ended), the courier sends it at once."""
        if self.answered_at is not None:
            after = min(asyncio.get_running_loop().time() - self.answered_at, 2 * HOLD_MAX_S)
            self.answered_at = None
            self.report_after = _smoothed(self.report_after, after)
        self.reported.set()
        self._deliver_soon()

    def _deliver_soon(self) -> None:
        """Reports wait and no claim will carry them (the main loop's claim waits for
        work, or the loop ended): the courier sends them now, unless it runs already."""
        idle = self.courier is None or self.courier.done()
        if idle and self.outbox and (self.claiming or not self.working):
            self.courier = asyncio.create_task(self._deliver())

    def _answered(self, answer: TurnAnswer) -> None:
        """A claim came back: whether core answered it without waiting for work (the
        next is likely answered as soon), and how long such claims take."""
        self.quick = bool(answer.attempts) and not answer.waited
        if self.quick:
            rtt = asyncio.get_running_loop().time() - self.claim_sent
            self.quick_rtt = _smoothed(self.quick_rtt, rtt)

    def _ride_s(self) -> float:
        """How much longer the reports waiting may wait for the next claim to carry them
        (0: the courier sends them now): while the last claim was answered without
        waiting for work, so that the one in flight is likely answered as soon and the
        main loop's next claim goes at once with every report then waiting (a turn fewer
        for them), until that claim is twice as old as such claims take (at most
        ``RIDE_MAX_S``): it may be waiting for work after all."""
        if not (self.claiming and self.quick):
            return 0.0
        patience = min(RIDE_MAX_S, 2 * self.quick_rtt)
        return self.claim_sent + patience - asyncio.get_running_loop().time()

    async def _deliver(self) -> None:
        delay = 0.2
        while self.outbox:
            ride = self._ride_s()
            if ride > 0:
                await asyncio.sleep(ride)
                continue
            if await self._turn(None) is None and self.outbox:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _pause(self, seconds: float, wake: asyncio.Event | None = None) -> None:
        """Sleep up to ``seconds``; draining (or ``wake``) ends it early."""
        if wake is not None:
            wake.clear()
        events = [self.draining.wait()] + ([wake.wait()] if wake is not None else [])
        waiters = [asyncio.ensure_future(e) for e in events]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _drain(self) -> None:
        grace = self.settings.worker_drain_grace_s
        telling = self._tell_draining()  # core leases this worker nothing more
        self._launch()  # leased last: each hands itself back (draining is set)
        log.info("draining: %d attempts running, %g s grace", len(self.tasks), grace)
        for attempt_id in list(self.holding):
            self._wake(attempt_id, "drain")  # not started yet: handed back at once
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        # Core's word still counts while draining: cancelled or preempted attempts stop.
        while self.tasks and loop.time() < until:
            self._keep_sidecar()
            self._obey_core()
            await asyncio.wait(set(self.tasks), timeout=min(0.2, max(0.0, until - loop.time())))
        # Attempts still being prepared hand themselves back (draining is set); those
        # running are terminated and handed back.
        deadline = asyncio.get_running_loop().time() + 30.0
        while self.tasks and asyncio.get_running_loop().time() < deadline:
            for _, handle in list(self.running.values()):
                if handle is not None and not handle.done:
                    await handle.terminate(grace_s=5.0)
            await asyncio.wait(set(self.tasks), timeout=1.0)
        # Before the worker leaves, within the drain's turn's own bound (a core that does
        # not answer costs that bound once, not again here).
        await asyncio.wait({telling}, timeout=max(0.0, self.told_by - loop.time()))

    # --- what core says through the sidecar ---

    def _obey_core(self) -> None:
        self._obey(state.read(self.folder / state.ANSWER))

    def _obey(self, answer: dict[str, Any]) -> None:
        if answer.get("state") == Workers.DEAD:
            self.dead = True
        elif answer.get("state") in (Workers.DRAINING, Workers.LEFT):
            self.draining.set()
        for attempt_id in answer.get("stop", []):
            entry = self.running.get(int(attempt_id))
            if entry and entry[1] is not None:
                log.info("attempt %s stopped at core's request", attempt_id)
                entry[1].kill()
            else:
                self._wake(int(attempt_id), "stop")
        for attempt_id in answer.get("squeeze", []):
            self._squeeze(int(attempt_id))
        grace = float(answer.get("preempt_grace_s", 10.0))
        for attempt_id in answer.get("preempt", []):
            self._preempt(int(attempt_id), grace)
        self._relieve_memory(grace)

    def _relieve_memory(self, grace_s: float) -> None:
        """Under memory pressure (the host's available memory below the threshold),
        preempt one preemptible attempt at a time, the one furthest over its charge,
        before the kernel's OOM killer reaches guaranteed work."""
        if self.preempting:
            return
        available = pressure.available_mb()
        threshold = self.memory_floor_mb
        if available is None or available >= threshold:
            return
        excess = pressure.excess(
            (attempt_id, assignment, handle)
            for attempt_id, (assignment, handle) in self.running.items()
            if handle is not None and not handle.done
        )
        if excess:
            why = f"memory pressure: {available} MB available on the host, under {threshold} MB"
            self._preempt(excess[0], grace_s, why)

    def _squeeze(self, attempt_id: int) -> None:
        entry = self.running.get(attempt_id)
        if attempt_id in self.squeezed or not entry or entry[1] is None:
            return
        how = squeeze(entry[1].pid, attempt_id, entry[1].spec.cgroup)
        self.squeezed.add(attempt_id)
        log.info("attempt %s squeezed for guaranteed work (%s)", attempt_id, how)

    def _preempt(self, attempt_id: int, grace_s: float, why: str | None = None) -> None:
        self._wake(attempt_id, "preempt")
        entry = self.running.get(attempt_id)
        if attempt_id in self.preempting or not entry or entry[1] is None:
            return
        if why is not None:
            self.preempt_reasons[attempt_id] = why
        log.info("attempt %s preempted: SIGTERM, %g s grace, SIGKILL", attempt_id, grace_s)
        stopping = asyncio.create_task(entry[1].terminate(grace_s, why="preempted"))
        self.preempting[attempt_id] = stopping
        stopping.add_done_callback(lambda _: self.preempting.pop(attempt_id, None))

    def _held(self, assignment: Assignment) -> tuple[float, float]:
        """What the attempt holds of this host, as core charged it."""
        held = assignment.charge or assignment.resources
        cpu = held.cpu
        if assignment.attempt_id in self.squeezed:
            cpu *= SQUEEZED_CPU_SHARE
        return cpu, held.memory_mb

    def _room(self) -> tuple[float, int, int]:
        # An attempt whose report waits for its turn frees its room in that turn.
        ended = self.outbox.keys() | self.sending.keys()
        held = [self._held(a) for i, (a, _) in self.running.items() if i not in ended]
        cpu = self.settings.worker_cpu - sum(c for c, _ in held)
        memory = int(self.settings.worker_memory_mb - sum(m for _, m in held))
        # One still being released holds its slot (its uid, its pooled cgroup) a little
        # longer: releases never pile up behind a burst.
        return cpu, memory, self.settings.worker_slots - len(held) - len(self.releasing)

    def _publish(self, now: bool = False) -> None:
        """Tell the sidecar which attempts this agent holds (``state.Board``). Changes
        of one loop iteration are written once, on the next (each write is the whole
        value); ``now`` writes at once, for what the sidecar must know before the next
        step (an exec)."""
        if now:
            if self.publishing is not None:
                self.publishing.cancel()
                self.publishing = None
            self._write_attempts()
        elif self.publishing is None:
            self.publishing = asyncio.get_running_loop().call_soon(self._publish_soon)

    def _publish_soon(self) -> None:
        self.publishing = None
        self._write_attempts()

    def _write_attempts(self) -> None:
        pids = {a: h.pid if h else 0 for a, (_, h) in self.running.items()}
        self.board.write_json(self.holdings.encode(os.getpid(), self.seen, pids, self.starting))

    # --- one attempt ---

    async def _attempt(self, assignment: Assignment) -> None:
        attempt = assignment.attempt_id
        logs.bind(task_id=assignment.task_id, attempt_id=attempt)
        log.debug("attempt %s of task %s starts", attempt, assignment.task_id)
        try:
            with tracing.span(
                "worker",
                "cairn.attempt.run",
                tracing.from_traceparent(assignment.traceparent),
                {"cairn.task_id": assignment.task_id, "cairn.attempt_id": attempt},
            ) as span:
                report = await self._execute(assignment)
                if report is not None:
                    if span is not None:
                        span.set_attribute("cairn.outcome", report.outcome)
                    await self._report(attempt, report)
        except Exception:
            log.exception("attempt %s failed inside the agent", attempt)
            await self._report(attempt, Report(outcome="failed", error="the agent failed"))
        finally:
            self.timings.mark(attempt, "reported")
            self.timings.done(attempt)
            self.ran[attempt] = None
            while len(self.ran) > RAN_KEPT:
                self.ran.popitem(last=False)
            self.running.pop(attempt, None)
            self.squeezed.discard(attempt)
            self._publish()

    async def _execute(self, assignment: Assignment) -> Report | None:
        try:
            assignment = self._with_devices(assignment)
        except DevicesBusy as exc:
            log.warning("attempt %s handed back: %s", assignment.attempt_id, exc)
            return Report(outcome="handed_back", error=str(exc))
        try:
            return await self._prepared(assignment)
        finally:
            held = self.held_devices.pop(assignment.attempt_id, None)
            if held is not None:
                self.devices.give_back(held)

    def _with_devices(self, assignment: Assignment) -> Assignment:
        """The assignment with the devices it holds taken from the pool and named in
        its environment (``devices.Held.env``); as it was on a worker without devices."""
        if not self.devices.offered:
            return assignment
        want = assignment.charge.devices if assignment.charge else assignment.resources.devices
        held = self.devices.take(want)
        self.held_devices[assignment.attempt_id] = held
        env = {**assignment.env, **held.env(self.devices.offered)}
        return assignment.model_copy(update={"env": env})

    async def _prepared(self, assignment: Assignment) -> Report | None:
        attempt = assignment.attempt_id
        try:
            held = self.held_devices.get(attempt)
            devices = held.indexes if held is not None else None
            prepared = await self.host.prepare(assignment, self.cache, devices)
            self.timings.mark(attempt, "prepared")
        except ArtifactError as exc:
            return Report(outcome="failed", error=exc.reason, retryable=exc.retryable)
        except Unenforceable as exc:
            return Report(outcome="failed", error=str(exc), retryable=False)
        except (IsolationError, OSError) as exc:
            log.error("attempt %s cannot be prepared: %s", attempt, exc)
            return Report(outcome="handed_back", error="the worker could not prepare it")
        try:
            return await self._run(assignment, prepared)
        finally:
            if prepared.unsettled is None:
                self._unlist(attempt)
            self._release(attempt, prepared)

    def _unlist(self, attempt_id: int) -> None:
        """The attempt's cgroup and uid off the board: nothing of it is left to kill."""
        self.holdings.unconfine(attempt_id)

    def _release(self, attempt_id: int, prepared: Prepared) -> None:
        """Remove the attempt's folders and hand back its slot and uid, after the report
        is queued (its processes are already gone: ``stop_leftovers``), so neither the
        report nor the room it frees waits for a folder to be removed. One whose start
        was given up on after it was sent (``Prepared.unsettled``) stays on the board
        until then: its process may yet be born, and were the agent's loop to stand
        still meanwhile, its sidecar's kills reach it there."""

        async def release() -> None:
            try:
                await self.host.release(prepared)
            except Exception:
                log.exception("attempt %s's folders or cgroup not released", attempt_id)
            finally:
                if prepared.unsettled is not None:
                    self._unlist(attempt_id)
                    self._publish()

        task = asyncio.create_task(release())
        self.releasing.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task[None]) -> None:
        self.releasing.discard(task)
        self.reported.set()  # room again: a main loop waiting for room looks again

    async def _cleared(self, assignment: Assignment) -> tuple[bool, Report | None]:
        """Whether the attempt may start now, once its hold (if leased ahead) is over and
        core vouches for it; if not, what to report (None: core knows already)."""
        attempt = assignment.attempt_id
        if self.draining.is_set():
            return False, DRAINING
        # A recent turn vouches for the lease; only after a long silence does the agent
        # ask, and always for one leased ahead, just before its start.
        if assignment.start_at is not None:
            verdict = await self._held_until_start(attempt, assignment.start_at.timestamp())
        else:
            verdict = "held" if self._vouched() else await self._confirm(attempt)
        if verdict in ("gone", "stop"):
            return False, None  # core closed it (cancelled, re-placed): it never starts
        if verdict == "preempt":
            return False, Report(outcome="preempted", error="preempted before its start")
        if verdict == "unconfirmed":
            why = "core could not confirm it before its start"
            return False, Report(outcome="handed_back", error=why)
        if self.draining.is_set():  # it came while the attempt was held or confirmed
            return False, DRAINING
        return True, None

    async def _held_until_start(self, attempt_id: int, start: float) -> str:
        """Hold a lease taken ahead until its start (core's clock, read against this
        host's): ``CONFIRM_BEFORE_S`` before it (``confirm_at``), ask core whether it
        still holds it (with every other one due then, in one request), so a cancel until
        then is seen and the start itself waits on no round trip; then start at the
        instant. ``held``, or
        why not: ``gone``/``unconfirmed`` (core's answer), ``stop``, ``preempt``,
        ``drain`` (what woke it first). Its folders and artifact are ready meanwhile, and
        it keeps its slot and charge."""
        woken = await self._hold(attempt_id, confirm_at(start))
        if woken != "start":
            return woken
        verdict = await self._confirm_held(attempt_id)
        if verdict != "held":
            return verdict
        woken = await self._hold(attempt_id, start)  # a beat's stop still counts here
        return "held" if woken == "start" else woken

    async def _spawn(self, prepared: Prepared, spec: AttemptSpec) -> RunningAttempt | Report:
        """The started attempt, or the report of why it could not start."""
        began = time.monotonic()
        try:
            return await self.host.launch(prepared, self.cache, spec)
        except SourceUnchecked as exc:  # unanswered too: this host's fault, not the task's
            # Kept one source limit from the try's start before it goes back (a held path
            # fails at once): at most one hand-back per limit and slot, never a hot loop.
            limit = spec.sandbox.source_timeout_s if spec.sandbox else None
            await asyncio.sleep(max(0.0, (limit or 0.0) - (time.monotonic() - began)))
            log.warning("attempt %s handed back: %s", spec.attempt_id, exc)
            # An unanswered source is counted by core, which buries a task whose source
            # never answers; a check this helper could not make says nothing of the source.
            cause = "source" if isinstance(exc, SourceUnanswered) else None
            return Report(outcome="handed_back", error=str(exc), hand_back_cause=cause)
        except SpawnError as exc:
            return Report(outcome="failed", error=str(exc), retryable=exc.retryable)
        except ArtifactError as exc:  # its source changed since it was prepared
            return Report(outcome="failed", error=exc.reason, retryable=exc.retryable)
        except OSError as exc:  # sealing its changed source again failed (as in prepare)
            log.error("attempt %s cannot be prepared: %s", prepared.spec.attempt_id, exc)
            return Report(outcome="handed_back", error="the worker could not prepare it")

    async def _run(self, assignment: Assignment, prepared: Prepared) -> Report | None:
        attempt, spec = assignment.attempt_id, prepared.spec
        cleared, refusal = await self._cleared(assignment)
        if not cleared:
            return refusal
        self.holdings.confine(
            attempt,
            [str(f) for f in prepared.cgroup.folders.values()] if prepared.cgroup else None,
            prepared.identity.uid if prepared.identity else None,
        )
        # Recorded before exec: if the agent dies from here on, the sidecar tells core
        # the attempt had started, so it counts as a crash.
        self.timings.mark(attempt, "vouched")
        self.starting.add(attempt)
        self._publish(now=True)
        self.timings.mark(attempt, "published")
        ports = probes.pick_ports(assignment.service) if assignment.service else {}
        if ports:
            spec = dataclasses.replace(spec, env={**spec.env, **probes.port_env(ports)})
        try:
            handle = await self._spawn(prepared, spec)
        finally:
            self.starting.discard(attempt)
        if isinstance(handle, Report):
            return handle
        self.timings.mark(attempt, "spawned")
        if attempt in self.held_devices:
            self.devices.started(self.held_devices[attempt], handle.pid)
        self.running[attempt] = (assignment, handle)
        self.started.add(attempt)
        self._publish()
        self.logs.register(self.worker_id, attempt, handle.log)
        self._watch(attempt, prepared.folders.view, spec.progress_timeout_s)
        probing = self._probe(assignment, handle, ports)
        late: int | None = None  # the output's length, if its log's end is still on its way
        try:
            result = await handle.wait()
            self._look(attempt, self.watches.get(attempt))  # its last words
            self.timings.mark(attempt, "exited")
            await self.host.stop_leftovers(prepared)
            # Still ours until core has the report: listed in every heartbeat (the sidecar
            # names all the board holds), its pid 0 now that the id may name another group.
            self.running[attempt] = (assignment, None)
            self._publish()
            late = await self.logs.finish(attempt)  # the rest of its log, before the report
        finally:
            self.watches.pop(attempt, None)
            self.logs.release(attempt, handle.log.close)
            if probing is not None:
                await self._unprobe(attempt, probing)
        report = outputs.attach(report_of(result), prepared.folders.view)
        why = self.preempt_reasons.pop(attempt, None)
        if report is not None and report.outcome == "preempted" and why:
            report = report.model_copy(update={"error": why})
        if report is not None and late is not None:
            report = report.model_copy(update={"log_bytes": late})
        return report

    # --- services' probes (docs/services.md) ---

    def _probe(
        self, assignment: Assignment, handle: RunningAttempt, ports: dict[str, int]
    ) -> tuple[asyncio.Task[None], probes.Prober] | None:
        """Start the replica's probes: a failed startup or liveness probe stops it as
        ``unhealthy``; each readiness flip goes to core."""
        # A service without probes is ready once it runs: its controller counts it.
        service = assignment.service or (ServiceSpec() if assignment.kind == "service" else None)
        if service is None:
            return None
        attempt = assignment.attempt_id
        sandbox = handle.spec.sandbox
        own_network = sandbox is not None and sandbox.netns
        target = probes.Target(
            handle.spec, ports, handle.pid if own_network else None, pid=handle.pid
        )

        def fail(why: str) -> None:
            log.info("attempt %s: %s", attempt, why)
            stopping = asyncio.create_task(
                handle.terminate(handle.spec.kill_grace_s, why="unhealthy", detail=why)
            )
            self.stalling.add(stopping)
            stopping.add_done_callback(self.stalling.discard)

        def ready(flag: bool) -> None:
            self.replicas.tell(attempt, flag, ports, reachable=not own_network)

        prober = probes.Prober(service, target, fail, ready)
        return asyncio.create_task(prober.run(), name=f"probes-{attempt}"), prober

    async def _unprobe(
        self, attempt: int, probing: tuple[asyncio.Task[None], probes.Prober]
    ) -> None:
        self.replicas.forget(attempt)
        task, prober = probing
        task.cancel()
        [ended] = await asyncio.gather(task, return_exceptions=True)
        if isinstance(ended, Exception):
            log.error("attempt %s's probes failed: %s", attempt, ended)
        prober.close()

    # --- progress (docs/progress.md) ---

    def _watch(self, attempt_id: int, workdir: Path, stall_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        self.watches[attempt_id] = progress.Watch(workdir, loop.time(), stall_s)
        if self.watcher is None or self.watcher.done():
            self.watcher = asyncio.create_task(self._watch_all())

    async def _watch_all(self) -> None:
        """Look at every running attempt's progress files on a timer, while any runs;
        end an attempt that has stalled."""
        loop = asyncio.get_running_loop()
        while self.watches:
            await asyncio.sleep(self.settings.worker_progress_poll_s)
            for attempt_id, watch in list(self.watches.items()):
                self._look(attempt_id, watch)
                if watch.stalled(loop.time()):
                    watch.stall_s = None
                    self._stall(attempt_id)

    def _look(self, attempt_id: int, watch: progress.Watch | None) -> None:
        if watch is None:
            return
        try:
            note, problems = watch.look(attempt_id, asyncio.get_running_loop().time())
        except Exception:
            log.exception("attempt %s's progress files could not be read", attempt_id)
            return
        entry = self.running.get(attempt_id)
        handle = entry[1] if entry else None
        for problem in problems:
            if handle is not None:
                handle.log.note(f"cairn: {problem}: ignored, the last good one is kept\n")
        if note is not None:
            self.notes[attempt_id] = progress.merge(self.notes.get(attempt_id), note)
            self._note_soon()

    def _stall(self, attempt_id: int) -> None:
        entry = self.running.get(attempt_id)
        handle = entry[1] if entry else None
        if handle is None or handle.done:
            return
        log.info(
            "attempt %s stalled: no progress for %s s", attempt_id, handle.spec.progress_timeout_s
        )
        stopping = asyncio.create_task(handle.terminate(handle.spec.kill_grace_s, why="stalled"))
        self.stalling.add(stopping)
        stopping.add_done_callback(self.stalling.discard)

    async def _hold(self, attempt: int, until: float) -> str:
        """Wait until the wall clock's ``until`` on an event-loop timer: ``start``, or what
        woke it first: ``stop`` (core closed it), ``preempt`` or ``drain``."""
        loop = asyncio.get_running_loop()
        try:
            # Again if the timer (monotonic) rang a hair before the wall clock's instant.
            while (delay := until - time.time()) > 0:
                if self.draining.is_set():
                    return "drain"
                wake: asyncio.Future[str] = loop.create_future()
                self.holding[attempt] = wake
                timer = loop.call_later(delay, _ring, wake, "start")
                try:
                    woken = await wake
                finally:
                    timer.cancel()
                if woken != "start":
                    return woken
            return "start"
        finally:
            self.holding.pop(attempt, None)

    def _wake(self, attempt_id: int, why: str) -> None:
        wake = self.holding.get(attempt_id)
        if wake is not None:
            _ring(wake, why)

    async def _confirm_held(self, attempt_id: int) -> str:
        """``_confirm`` for an attempt leased ahead whose start_at has come, batched with
        every other one whose start came in this loop iteration."""
        loop = asyncio.get_running_loop()
        verdict: asyncio.Future[str] = loop.create_future()
        self.confirming[attempt_id] = verdict
        if self.confirm_soon is None:
            self.confirm_soon = loop.call_soon(self._ask_starts)
        return await verdict

    def _ask_starts(self) -> None:
        self.confirm_soon = None
        batch, self.confirming = self.confirming, {}
        task = asyncio.create_task(self._starts(batch))
        self.asking.add(task)
        task.add_done_callback(self.asking.discard)

    async def _starts(self, batch: dict[int, asyncio.Future[str]]) -> None:
        """One request per chunk: ``held``, ``gone``, or ``unconfirmed`` for each."""
        ids = sorted(batch)
        try:
            for at in range(0, len(ids), MAX_STARTS):
                chunk = ids[at : at + MAX_STARTS]
                verdicts = await self._ask(chunk)
                for attempt_id in chunk:
                    _ring(batch[attempt_id], verdicts.get(attempt_id, "gone"))
        except Exception:
            log.exception("cannot ask core about attempts %s", ids)
        finally:
            for waiting in batch.values():
                _ring(waiting, "unconfirmed")

    async def _ask(self, chunk: list[int]) -> dict[int, str]:
        delay = 0.2
        for _ in range(5):
            try:
                answer = await self.client.start_attempts(self.worker_id, chunk)
            except NotFound as exc:  # core knows no such worker: none of them is held
                log.warning("attempts %s not started: %s", chunk, exc)
                return dict.fromkeys(chunk, "gone")
            except (httpx.TransportError, CairnError) as exc:
                log.warning("cannot confirm attempts %s yet: %s", chunk, exc)
                await asyncio.sleep(delay)
                delay *= 2
                continue
            if answer.gone:
                log.warning("attempts %s no longer held: not started", answer.gone)
            return {**dict.fromkeys(answer.gone, "gone"), **dict.fromkeys(answer.held, "held")}
        return dict.fromkeys(chunk, "unconfirmed")

    async def _confirm(self, attempt_id: int) -> str:
        """Ask core before starting: an attempt it no longer holds for this worker (the
        reaper requeued it, it was cancelled) must not run beside its retry. ``held``,
        ``gone``, or ``unconfirmed`` (core unreachable for a few seconds)."""
        delay = 0.2
        for _ in range(5):
            try:
                await self.client.start_attempt(self.worker_id, attempt_id)
                return "held"
            except (Conflict, NotFound) as exc:
                log.warning("attempt %s not started: %s", attempt_id, exc)
                return "gone"
            except (httpx.TransportError, CairnError) as exc:
                log.warning("cannot confirm attempt %s yet: %s", attempt_id, exc)
                await asyncio.sleep(delay)
                delay *= 2
        return "unconfirmed"

    async def _report(self, attempt_id: int, report: Report) -> None:
        """Queue the report for the next turn and wait until core has answered it; a
        refusal (stale, gone) is final; through outages it goes again, for a while."""
        loop = asyncio.get_running_loop()
        item = AttemptReport(attempt_id=attempt_id, **report.model_dump())
        if item.outputs is not None and not _encodable(item):
            # A report no turn could carry: each turn that took it would fail to encode,
            # and with it every report, start and claim it carried, again and again.
            # Only the task's outputs are the task's own structure (``outputs_problem``
            # checked them as they were read): the rest is the agent's, its text decoded
            # with replacement, and not encoded twice an attempt.
            item = AttemptReport(
                attempt_id=attempt_id, outcome="failed", error=UNENCODABLE, retryable=False
            )
        out = Outgoing(item, loop.create_future(), loop.time() + REPORT_PATIENCE_S)
        self.outbox[attempt_id] = out
        self._kick()
        await out.done


def _heard_of(turn: asyncio.Task[TurnAnswer | None]) -> bool:
    """Whether a turn that is done was answered by core."""
    return not turn.cancelled() and turn.exception() is None and turn.result() is not None


def _ring(wake: asyncio.Future[str], why: str) -> None:
    if not wake.done():
        wake.set_result(why)


class Refused(Exception):
    """Core refused the agent's registration (its token, its offer): one line, exit 1."""


def _token(settings: WorkerSettings) -> str:
    """The worker token, from ``CAIRN_TOKEN_FILE`` or ``CAIRN_TOKEN``."""
    if settings.token_file is not None:
        return hardening.read_token(settings.token_file)
    if settings.token:
        return settings.token
    raise hardening.HardeningError(
        "CAIRN_TOKEN_FILE (a 0600 file) or CAIRN_TOKEN must hold a worker token "
        "(cairn token create NAME --role worker)"
    )


_DATABASE_VARIABLES = ("CAIRN_DATABASE_URL", "CAIRN_DATABASE_DIRECT_URL")


def _harden(settings: WorkerSettings) -> None:
    """Nothing of the agent's secrets stays where another process could read it."""
    for name in _DATABASE_VARIABLES:
        if name in os.environ:
            if settings.env == "production":
                raise hardening.HardeningError(f"a worker must not be given {name}")
            log.warning("%s is set for this worker: it is not used, and removed", name)
    hardening.scrub_environ("CAIRN_TOKEN", *_DATABASE_VARIABLES)
    hardening.non_dumpable()


def main(argv: list[str] | None = None) -> None:
    del argv
    settings = load(WorkerSettings, "cairn worker")
    logs.setup("worker", settings.log_level)
    tracing.setup("worker")
    host = Host(settings, settings.home / "logs")
    try:
        token = _token(settings)
        _harden(settings)
        notes = host.start()
    except (hardening.HardeningError, HostError, IsolationError) as exc:
        sys.exit(f"cairn worker: {exc}")
    for note in notes:
        log.info("isolation: %s", note)
    procs.settle_collector()

    async def run() -> None:
        # Folders, copies and removals of many attempts at once, each blocked on the disk
        # rather than the CPU: more threads than the default's cores + 4.
        io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="cairn-io")
        asyncio.get_running_loop().set_default_executor(io)
        async with CoreClient(settings.url, token) as client:
            await Agent(settings, client, token, host).run()

    try:
        asyncio.run(run())
    except Refused as refused:  # its attempts, sidecar and host are closed already
        sys.exit(f"cairn worker: {refused}")


if __name__ == "__main__":
    main()
