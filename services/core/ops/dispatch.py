"""The dispatch operations: a worker's turn (its reports, its start acknowledgements and
its claim in one transaction), the single claim and report built on it, and the reaper's
pass. Each owns its transaction, then tells the notifier and the metrics."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.errors import Conflict, NotFound, StaleAttempt
from libs.common.models import (
    Assignment,
    AttemptReport,
    ClaimRequest,
    Report,
    ReportVerdict,
    Turn,
    Worker,
    WorkerRegister,
)
from libs.common.states import TaskState, Workers
from services.core import traces
from services.core.db import attempts as attempts_db
from services.core.db import placement, secrets
from services.core.db import progress as progress_db
from services.core.db import workers as workers_db
from services.core.db.audit import Auditor
from services.core.db.feed import Notifier, Waiter, Work
from services.core.domain import selectors
from services.core.domain.outcomes import SOURCE_UNANSWERED_MAX
from services.core.domain.placement import ZERO, Amount
from services.core.identity.crypto import SecretBox
from services.core.ops.metrics import CoreMetrics

log = logging.getLogger("cairn.core.dispatch")

#: how long after a claim held work back (a quota, a concurrency key) reports that end
#: tasks sweep the waiting claims, so the work they release starts at once
HELD_WINDOW_S = 60.0


class Holds:
    """When this replica's claims last held work back by a limit that an ending task
    releases: while recent, reports sweep the waiting claims; otherwise an ending task
    wakes no one (no other claim can be helped by it). One per replica, in the app's
    state (a ``Dispatcher`` is made per request)."""

    def __init__(self) -> None:
        self.at = -math.inf

    def saw(self, tally: attempts_db.Tally) -> None:
        if tally.held:
            self.at = asyncio.get_running_loop().time()

    def recent(self) -> bool:
        return asyncio.get_running_loop().time() - self.at < HELD_WINDOW_S


#: the most worker rows a replica keeps for its claims' early picks (``Known``)
KNOWN_MAX = 10_000


class Known:
    """The worker rows this replica's turns last read, so that a worker's next claim
    sends its pick with the turn's first round trip (``attempts.early_ask``): at most
    ``KNOWN_MAX``, the longest unheard forgotten first. A row gone stale costs only
    that round trip's pick (``attempts.same_pick`` refuses it)."""

    def __init__(self) -> None:
        self.rows: dict[int, Any] = {}

    def get(self, worker_id: int) -> Any | None:
        return self.rows.get(worker_id)

    def saw(self, worker_id: int, row: Any | None) -> None:
        self.rows.pop(worker_id, None)
        if row is None:
            return
        self.rows[worker_id] = row
        if len(self.rows) > KNOWN_MAX:
            del self.rows[next(iter(self.rows))]


@dataclass(frozen=True)
class Dispatcher:
    """What the dispatch operations need: the database, who to tell, the secret box."""

    engine: AsyncEngine
    notifier: Notifier
    meter: CoreMetrics
    box: SecretBox
    defaults: placement.Defaults = field(default_factory=placement.Defaults)
    #: the most a claim may ask to lease ahead (``CAIRN_CLAIM_AHEAD_MAX_S``)
    ahead_max_s: float = 0.0
    holds: Holds = field(default_factory=Holds)
    known: Known = field(default_factory=Known)
    #: a turn leaves its worker's liveness times unwritten while younger than this
    #: (``domain.workers.turn_fresh_s``); 0: every turn writes them
    fresh_s: float = 0.0
    #: hand-backs in a row of a source that does not answer that bury its task
    #: (``CAIRN_SOURCE_UNANSWERED_MAX``)
    source_cap: int = SOURCE_UNANSWERED_MAX


@dataclass(frozen=True)
class TurnResult:
    """The worker's state after the turn, a verdict per report (in the order sent), the
    attempts leased, and whether its claim waited in the line for work (``waited``)."""

    state: str
    reports: list[ReportVerdict]
    attempts: list[Assignment]
    waited: bool = False


async def turn(
    ops: Dispatcher,
    worker_id: int,
    body: Turn,
    headers: Mapping[str, str] | None = None,
    gone: Callable[[], Awaitable[bool]] | None = None,
    record: Auditor | None = None,
) -> TurnResult:
    """One round trip of a worker: in one transaction, hear it (refresh its liveness
    when stale, note what it started; mark it draining first when the agent says it
    drains, ``Turn.draining``, audited by ``record`` as an admin's drain is), apply its
    reports, lease what fits its room. With ``claim.wait`` and nothing leased, claim
    again (alone) as work is announced, until the wait is over or the caller is
    ``gone``."""
    reported = [r.attempt_id for r in body.reports]
    ops.meter.turned(body.claim is not None, len(reported))
    waits = body.claim is not None and body.claim.wait > 0
    # Joined before the pick: work announced while it looks wakes it.
    waiter = ops.notifier.line.join(worker_id) if waits else None
    early = _early(ops, worker_id, body.claim)
    try:
        async with ops.engine.begin() as conn:
            drained = body.draining and await workers_db.start_draining(conn, worker_id)
            if drained and record is not None:
                await _drain_audited(conn, record, worker_id, Workers.LIVE)
            heard = await attempts_db.hear(
                conn,
                worker_id,
                body.started,
                reported,
                ops.fresh_s,
                body.holding is not None,
                early,
                waits,
            )
            ops.known.saw(worker_id, heard.worker)
            resent, resent_tally = await _resend(ops, conn, heard, body.holding)
            settled = await attempts_db.settle(
                conn, worker_id, body.reports, heard.reported, _masker(ops), ops.source_cap
            )
            asked = _ask(ops, heard, body.claim, settled.closing)
            notes = progress_db.noted(worker_id, body.progress)
            picked, later = await _pick(ops, conn, early, heard, asked, settled, notes, waits)
            verdicts, ended = await attempts_db.applied(conn, settled)
            leased, lease_tally = await _lease(ops, conn, asked, picked, later)
            state = await _state(conn, worker_id, heard, bool(picked) and not leased)
        if waiter is not None and heard.worker is not None:
            waiter.queues = frozenset(heard.worker.queues)
            waiter.facts = frozenset(selectors.facts(heard.worker.labels or {}))
        leased = resent + leased
        # Reports sent with a claim free room that claim's own pick already saw (it
        # follows them in this transaction), and the agent has no other claim out: they
        # wake none of its claims. Those sent alone may (``_told``).
        alone = body.claim is None
        freed = _freed(heard, verdicts) if alone else None
        _told(
            ops, ended + lease_tally + resent_tally, body.reports, verdicts, leased, headers,
            worker_id if alone else None, freed,
        )  # fmt: skip
        if drained:
            # Its claim waiting at core, on any replica, answers now (``drain``).
            ops.notifier.announce(Work(workers=frozenset([worker_id])))
        if waiter is None or leased or state != Workers.LIVE:
            return TurnResult(state, verdicts, leased)
        assert body.claim is not None
        ops.notifier.line.looked(waiter, _short(asked, picked))
        leased, state = await _wait_for_work(ops, worker_id, body.claim, gone, waiter)
        return TurnResult(state, verdicts, leased, waited=True)
    finally:
        if waiter is not None:
            ops.notifier.line.leave(waiter, used=False)


async def claim(
    ops: Dispatcher,
    worker_id: int,
    room: ClaimRequest,
    gone: Callable[[], Awaitable[bool]] | None = None,
) -> list[Assignment]:
    """A turn with no reports: the attempts leased."""
    return (await turn(ops, worker_id, Turn(claim=room), gone=gone)).attempts


async def report(
    ops: Dispatcher,
    worker_id: int,
    attempt_id: int,
    outcome: Report,
    headers: Mapping[str, str] | None = None,
) -> ReportVerdict:
    """A turn of one report and no claim: ``StaleAttempt`` or ``NotFound`` if refused."""
    item = AttemptReport(attempt_id=attempt_id, **outcome.model_dump())
    [verdict] = (await turn(ops, worker_id, Turn(reports=[item]), headers)).reports
    if verdict.status == 404:
        raise NotFound(verdict.detail)
    if verdict.status == 409:
        raise StaleAttempt(verdict.detail)
    return verdict


async def _state_of(conn: AsyncConnection, worker_id: int) -> str:
    return str((await workers_db.get_worker(conn, worker_id, None)).state)


async def _state(
    conn: AsyncConnection, worker_id: int, heard: attempts_db.Heard, missed: bool = False
) -> str:
    """The worker's state as the turn heard it; read again when the turn found it gone, or
    when its claim leased none of the work it picked (``missed``): the reaper may have
    buried the worker since the turn read its row unlocked (``attempts._HEARD``)."""
    if heard.worker is None or missed:
        return await _state_of(conn, worker_id)
    return str(heard.worker.state)


def _masker(ops: Dispatcher) -> attempts_db.Masker:
    def mask(conn: AsyncConnection, attempt_id: int) -> Awaitable[Callable[[str], str] | None]:
        return secrets.masker(conn, ops.box, attempt_id)

    return mask


def _freed(heard: attempts_db.Heard, verdicts: Sequence[ReportVerdict]) -> Amount:
    """What the attempts this turn's reports ended held on the worker."""
    ended = {v.attempt_id for v in verdicts if v.state is not None}
    return placement.held_by(row for row in heard.placed if row.id in ended)


def _early(
    ops: Dispatcher, worker_id: int, room: ClaimRequest | None, grown: Amount = ZERO
) -> attempts_db.Ask | None:
    """The claim's pick to send with the turn's first round trip, from its worker's row
    as this replica last read it (``Known``); None without a claim or a row."""
    worker = ops.known.get(worker_id)
    if worker is None or room is None:
        return None
    return attempts_db.early_ask(
        worker,
        room.cpu + grown.cpu,
        room.memory_mb + grown.memory_mb,
        room.max,
        ops.defaults,
        min(room.ahead_s, ops.ahead_max_s),
    )


async def _pick(
    ops: Dispatcher,
    conn: AsyncConnection,
    early: attempts_db.Ask | None,
    heard: attempts_db.Heard,
    asked: attempts_db.Ask | None,
    settled: attempts_db.Settled,
    notes: Sequence[Any],
    waits: bool = True,
) -> tuple[list[Any], list[Any]]:
    """The claim's pick, and the statements still to run before its lease: the early
    pick's rows when they are what ``asked`` picks (``attempts.same_pick``), the turn's
    reports and notes then going with the lease (one round trip fewer); otherwise the
    reports, then a pick after them (``finish_and_pick``). A service's exit is decided
    after its report's statement (``applied``): such a turn picks after them. Nothing
    follows a turn without a claim but a service's exit and, for a worker gone, its
    state: its COMMIT goes with its reports. ``waits``: the claim waits for work if it
    leases none (only then is whether any waited probed)."""
    services = any(move is None for _, _, move in settled.batch)
    found = heard.picked
    if (
        early is None
        or found is None
        or asked is None
        or services
        or not attempts_db.same_pick(early, asked, found)
    ):
        if asked is not None:
            ops.meter.claim_picks.labels("after" if early is None else "again").inc()
        picked = await attempts_db.finish_and_pick(
            conn, settled, asked, notes, last=True, waits=waits
        )
        return picked, []
    ops.meter.claim_picks.labels("first").inc()
    return found, [*notes, *settled.statements()]


def _ask(
    ops: Dispatcher,
    heard: attempts_db.Heard,
    room: ClaimRequest | None,
    closing: frozenset[int],
    grown: Amount = ZERO,
) -> attempts_db.Ask | None:
    """The claim's first half, in ``room`` (the agent's, when it sent the claim) grown by
    what its own reports have freed since (``grown``: ``Waiter.freed``)."""
    if heard.worker is None or room is None:
        return None
    return attempts_db.ask(
        heard.worker,
        heard.placed,
        heard.rest,
        room.cpu + grown.cpu,
        room.memory_mb + grown.memory_mb,
        room.max,
        ops.defaults,
        closing,
        min(room.ahead_s, ops.ahead_max_s),
    )


async def _lease(
    ops: Dispatcher,
    conn: AsyncConnection,
    asked: attempts_db.Ask | None,
    picked: list[Any],
    first: Sequence[Any] = (),
) -> tuple[list[Assignment], attempts_db.Tally]:
    """Lease what the pick found (after ``first``: ``_pick``), the secrets filled in; an
    attempt whose secret is gone fails at once (not retryable) and is not handed out.
    With what it counted."""
    if asked is None:
        return [], attempts_db.Tally()
    # Nothing follows the lease in the caller's transaction but the secrets' look-ups,
    # so a lease without secrets commits in its own round trip.
    leases = await attempts_db.lease(conn, asked, picked, last=True, first=first)
    return await _filled(ops, conn, asked.worker.id, leases)


async def _filled(
    ops: Dispatcher, conn: AsyncConnection, worker_id: int, leases: attempts_db.Leases
) -> tuple[list[Assignment], attempts_db.Tally]:
    """The leases' secrets filled in; an attempt whose secret is gone fails at once (not
    retryable) and is not handed out."""
    if not leases.with_secrets:
        return leases.assignments, leases.tally
    leased, broken = await secrets.fill(conn, ops.box, leases.assignments)
    if broken:
        failed = [
            AttemptReport(attempt_id=a, outcome="failed", retryable=False, error=reason)
            for a, reason in broken.items()
        ]
        _, ended = await attempts_db.report_many(conn, worker_id, failed)
        return leased, leases.tally + ended
    return leased, leases.tally


async def _resend(
    ops: Dispatcher,
    conn: AsyncConnection,
    heard: attempts_db.Heard,
    holding: Sequence[int] | None,
) -> tuple[list[Assignment], attempts_db.Tally]:
    """The worker never got its last turn's answer (``Turn.holding``): the attempts core
    leased it that it does not hold, to hand out again."""
    if holding is None or heard.worker is None:
        return [], attempts_db.Tally()
    leases = await attempts_db.resend(conn, heard.worker.id, holding)
    if leases.assignments:
        log.warning(
            "worker %s never got the lease of attempts %s; handing them out again",
            heard.worker.id,
            [a.attempt_id for a in leases.assignments],
        )
    return await _filled(ops, conn, heard.worker.id, leases)


async def _wait_for_work(
    ops: Dispatcher,
    worker_id: int,
    room: ClaimRequest,
    gone: Callable[[], Awaitable[bool]] | None,
    waiter: Waiter,
) -> tuple[list[Assignment], str]:
    """Wait in the line until woken, then look (a pick and a lease, alone); until the
    claim's wait is over. The claim's room is the agent's when it sent it: each look
    adds what the worker's own reports freed meanwhile (``Waiter.freed``), or a claim
    sent while an attempt ran would never see that attempt's room again. A look that
    leased and may have left work behind (it filled its room, or saw candidates it
    could not take) wakes the next waiter of its queues."""
    line = ops.notifier.line
    loop = asyncio.get_running_loop()
    deadline = loop.time() + room.wait
    while True:
        remaining = deadline - loop.time()
        if line.closed or remaining <= 0 or not await waiter.wait(remaining) or line.closed:
            return [], Workers.LIVE
        line.rest(waiter)
        if gone is not None and await gone():
            line.pass_on(waiter)  # its wake-up was meant for a claim that can use it
            return [], Workers.LIVE
        early = _early(ops, worker_id, room, waiter.freed)
        async with ops.engine.begin() as conn:
            heard = await attempts_db.hear(conn, worker_id, fresh_s=ops.fresh_s, early=early)
            ops.known.saw(worker_id, heard.worker)
            asked = _ask(ops, heard, room, frozenset(), waiter.freed)
            picked, _ = await _pick(ops, conn, early, heard, asked, attempts_db.Settled([], []), [])
            leased, tally = await _lease(ops, conn, asked, picked)
            state = await _state(conn, worker_id, heard, bool(picked) and not leased)
        _told(ops, tally, [], [], leased, None)
        ops.meter.claim_looks.labels("leased" if leased else "empty").inc()
        if leased:
            if asked is not None and (len(leased) >= asked.most or len(picked) > len(leased)):
                line.pass_on(waiter)
            return leased, state
        if state != Workers.LIVE:
            return leased, state
        line.looked(waiter, _short(asked, picked))
        line.back(waiter)  # nothing it could take: the next wake-up goes to the others


def counted(meter: CoreMetrics | None, notifier: Notifier, tally: attempts_db.Tally) -> None:
    """After the commit, what a call ended on the way: the metrics, and the earliest
    backoff it set (``Tally.due``) hinted to the promoters, so that a retry, a lost
    attempt placed again or a service's restart starts when its backoff ends, not at the
    promoter's next poll."""
    if meter is not None:
        meter.count(tally)
    if tally.due < math.inf:
        notifier.announce_due(datetime.fromtimestamp(tally.due, UTC))


def _short(asked: attempts_db.Ask | None, picked: list[Any]) -> bool:
    """Whether a look that leased nothing may have been short of room: it had none to
    fill, or work of its queues waited (``attempts.Picked``)."""
    return asked is None or getattr(picked, "waiting", True)


def _told(
    ops: Dispatcher,
    tally: attempts_db.Tally,
    items: Sequence[AttemptReport],
    verdicts: Sequence[ReportVerdict],
    leased: Sequence[Assignment],
    headers: Mapping[str, str] | None,
    worker_id: int | None = None,
    freed: Amount | None = None,
) -> None:
    """After the commit: metrics, traces, and one announcement for the lot. Reports that
    ended attempts of ``worker_id`` freed room on it: its own waiting claim (the agent's
    next claim may be waiting already, sent while these reports were on their way, and
    core then counted that room as taken) looks again, on whichever replica it waits;
    reports sent without a claim (``freed``: what their attempts held) were sent after
    that claim's room was measured, and grow it by what they freed. That claim looks
    again only if its last look may have been short of room (``feed.Line.may_grow``):
    one that found nothing waiting has nothing more to find."""
    counted(ops.meter, ops.notifier, tally)
    outcomes: Counter[str] = Counter()
    for item, verdict in zip(items, verdicts, strict=True):
        if verdict.state is None or verdict.task_id is None:
            continue
        outcomes[item.outcome] += 1
        if headers is not None:
            traces.reported(headers, verdict.task_id, item.attempt_id, item.outcome, verdict.state)
    # Counted once per kind, not per report (a label look-up each).
    for outcome, n in outcomes.items():
        ops.meter.attempts_finished.labels(outcome).inc(n)
    succeeded = sum(v.state is TaskState.SUCCEEDED for v in verdicts)
    ops.meter.ended(TaskState.SUCCEEDED, succeeded)
    ops.holds.saw(tally)
    applied = outcomes.total()
    if applied or leased or tally.lost or tally.buried:
        # Work for waiting claims: tasks whose attempts were lost are back in line; an
        # ending task helps another claim only if a limit held work back (``Holds``).
        released = applied > 0 and ops.holds.recent()
        mine = frozenset([worker_id]) if applied and worker_id is not None else frozenset()
        grown = {worker_id: freed} if mine and worker_id is not None and freed is not None else {}
        ops.notifier.announce(Work(any=tally.lost, sweep=released, ended=mine, freed=grown))
    ended = [v.attempt_id for v in verdicts if v.state is not None]
    if ended:
        ops.notifier.announce_log(ended)  # their logs are complete: followers end


async def heartbeat(
    ops: Dispatcher,
    worker: Any,
    alive: Sequence[int],
    grace_s: float,
    hung_s: float | None = None,
    hung: tuple[int, int] = (0, 0),
    seen: int | None = None,
) -> tuple[workers_db.Beat, str]:
    """The sidecar's beat (``db.workers.heartbeat``), and the worker's state after it.
    ``hung_s``: the sidecar saw its agent hang and killed its attempts; the worker is
    dead at once (``db.workers.bury_hung``). ``hung``: what of the agent hangs on
    sources that did not answer (threads, checkers), kept for the gauges. ``seen``:
    ``Heartbeat.seen``."""
    async with ops.engine.begin() as conn:
        if hung_s is not None:
            tally = await workers_db.bury_hung(conn, worker.id, hung_s)
            found = workers_db.Beat([], [], [], tally.lost, tally)
        else:
            found = await workers_db.heartbeat(conn, worker, list(alive), grace_s, hung, seen)
        state = found.state or await _state_of(conn, worker.id)
    counted(ops.meter, ops.notifier, found.tally)
    if found.lost:
        ops.notifier.announce(Work(any=found.tally.lost))
    return found, state


async def leave(ops: Dispatcher, worker_id: int) -> None:
    """The worker left: every attempt it still holds is lost at once."""
    async with ops.engine.begin() as conn:
        await workers_db.set_worker_state(conn, worker_id, Workers.LEFT)
        tally = await workers_db.lose_all(conn, worker_id, "its worker left")
    counted(ops.meter, ops.notifier, tally)
    if tally.lost:
        ops.notifier.announce(Work(any=tally.lost))


# --- the reaper ---------------------------------------------------------------------------


async def reap(
    engine: AsyncEngine,
    notifier: Notifier,
    timeout_s: float,
    hearing: Callable[[], float] = lambda: math.inf,
    meter: CoreMetrics | None = None,
    hang_s: float = math.inf,
) -> int:
    """One pass of the reaper: workers silent for ``timeout_s``, or whose agent took no
    turn for ``hang_s``, are dead, their attempts lost (``db.workers.reap``).
    ``hearing``, called once the database answered, says how long this replica has heard
    without a break."""
    async with engine.begin() as conn:
        await workers_db.answer(conn)
        changed, tally, buried = await workers_db.reap(
            conn, timeout_s, hang_s=hang_s, heard_for_s=hearing()
        )
    for worker_id, why, lost in buried:
        # the line an operator looks for when work moved: which worker, why, what it cost
        log.warning(
            "worker %s declared dead (%s); attempts lost: %d",
            worker_id,
            why.removeprefix("its "),
            lost,
            extra={"worker_id": worker_id},
        )
    counted(meter, notifier, tally)
    if changed:
        notifier.announce(Work(any=tally.lost))
    return changed


async def register(
    engine: AsyncEngine, principal: str, offer: WorkerRegister
) -> tuple[Worker, str]:
    """A worker agent starts: its row and its lease secret (shown once)."""
    async with engine.begin() as conn:
        return await workers_db.register(conn, principal, offer)


async def confirm_start(engine: AsyncEngine, attempt_id: int, worker_id: int) -> int:
    """The task of an attempt core still holds for the worker (409 when it does not)."""
    async with engine.begin() as conn:
        return await attempts_db.confirm_start(conn, attempt_id, worker_id)


async def drain(engine: AsyncEngine, notifier: Notifier, record: Auditor, worker_id: int) -> None:
    """Stop giving a live worker new work (409 for one gone), audited; its waiting claim
    (on any replica) wakes to answer that it drains."""
    async with engine.begin() as conn:
        row = await workers_db.get_worker(conn, worker_id, None)
        if row.state not in Workers.PRESENT:
            raise Conflict(f"worker {worker_id} is {row.state}; only a live worker drains")
        await workers_db.set_worker_state(conn, worker_id, Workers.DRAINING)
        await _drain_audited(conn, record, worker_id, row.state)
    notifier.announce(Work(workers=frozenset([worker_id])))


async def _drain_audited(conn: AsyncConnection, record: Auditor, worker_id: int, was: str) -> None:
    """The audit row of a drain: an admin's (``drain``) or the agent's own (``turn``)."""
    await record(
        conn,
        "worker.drain",
        f"worker:{worker_id}",
        before={"state": was},
        after={"state": Workers.DRAINING},
    )
