"""What a person or a service does to tasks, each in its transaction(s), then the notifier
and the metrics: submit (one routine for one task and a batch), cancel and retry one,
and the bulk actions. The API parses, authorises (a queue's policy), calls and shapes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.client import ON_BEHALF_OF
from libs.common.errors import Forbidden, InvalidInput, QuotaExceeded
from libs.common.models import MAX_AHEAD_S, MAX_BULK_COUNT, BulkAction, BulkResult, Task, TaskCreate
from libs.common.states import TaskState
from services.core import traces
from services.core.db import principals, secrets, sharing, teams
from services.core.db import tasks as tasks_db
from services.core.db.audit import Auditor
from services.core.db.feed import Notifier, Work
from services.core.domain import limits, selectors
from services.core.domain import services as service_rules
from services.core.domain.principals import Principal
from services.core.domain.sharing import FairShare
from services.core.domain.transitions import Op
from services.core.ops.groupcommit import GroupCommit
from services.core.ops.metrics import CoreMetrics

# --- rules a submission and a retry share ----------------------------------------------


def policy_role(principal: Principal, owner: str) -> str:
    """The role a queue's policy sees: a service submitting for someone else is held to
    what that person (a user) may ask for."""
    return "user" if principal.role == "service" and owner != principal.name else principal.role


async def check_owner(
    conn: AsyncConnection, principal: Principal, owner: str, spec: secrets.Asks, field: str = ""
) -> None:
    """The owner's right to its team and secrets: the caller's teams when it submits for
    itself; when a service submits for it (or a teammate retries its task), the teams the
    owner holds without a token: recorded, or claimed by a verified token of theirs that
    still stands (``teams.standing_teams``)."""
    if owner != principal.name:
        # A service acting for the owner (a cron fire, a DAG node) or a teammate's retry:
        # a claim a verified token made lately stands, and the lease of what is
        # submitted under it is honoured while it does.
        owner_teams = await teams.standing_teams(conn, owner)
        wanted = secrets.teams_used(spec) | ({spec.team} if spec.team else set())
        await teams.stand_for(conn, owner, wanted & owner_teams)
    else:
        owner_teams = principal.teams
        if principal.id is None and principal.claims_until is not None:
            # An identity provider vouches for these teams (for a bounded time): kept, so
            # that the lease, which has no token at hand, checks the same membership.
            used = secrets.teams_used(spec) & owner_teams
            await teams.vouch(
                conn, owner, used, owner_teams, principal.claims_until, principal.key_id
            )
    await secrets.check_submission(conn, owner, owner_teams, spec, field)


async def may_retry(
    conn: AsyncConnection, book: sharing.Book, principal: Principal, task: Task
) -> None:
    """A retry puts the task to work again as its owner, so it is checked as submitting
    it would be now: the owner's teams and secrets (``check_owner``) and the queue's
    policy, for the owner and, when a user retries a teammate's task, for that user too;
    another's retry of a disabled owner's task is refused as a service's submission is."""
    if task.owner != principal.name:
        await principals.refuse_disabled(conn, [task.owner], lambda _: "task.owner")
    book.check_policy(policy_role(principal, task.owner), task.owner, task, "task")
    if principal.role == "user" and principal.name != task.owner:
        book.check_policy("user", principal.name, task, "task")
    if secrets.needs_check(task):
        await check_owner(conn, principal, task.owner, task)


async def _admit(
    conn: AsyncConnection,
    book: sharing.Book,
    owners: Sequence[str],
    meter: CoreMetrics,
    teams: Sequence[str | None],
) -> None:
    try:
        await sharing.admit_submissions(conn, book, owners, teams)
    except QuotaExceeded as refused:
        meter.quota_refusals.labels(refused.extra["quota"]).inc()
        raise


# --- submit ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submitter:
    """Who submits, and core's handles: what every submission needs besides its tasks."""

    principal: Principal
    engine: AsyncEngine
    notifier: Notifier
    meter: CoreMetrics
    book: sharing.Book
    quantum: float
    #: core's defaults of a task's limits (``domain.limits``)
    defaults: limits.Defaults = field(default_factory=limits.Defaults)
    #: whether queues weigh decayed usage in fair share by default (docs/sharing.md)
    fair: FairShare = field(default_factory=FairShare)
    #: the writer that stores single submissions together (``ops.groupcommit``); None:
    #: each in its own statement
    group: GroupCommit | None = None
    #: which owners are disabled, as this replica read them lately; None: read each time
    disabled: principals.DisabledOwners | None = None


def fill_limits(
    by: Submitter, specs: Sequence[TaskCreate], field: Callable[[int], str]
) -> list[limits.Filled]:
    """Each submission's time limits by its queue's and core's (one rule for every
    submitter: a person, a cron fire, a DAG node); 422 naming the field when one asks
    for more than its queue allows."""
    return [
        limits.fill(
            spec.kind,
            spec.timeout_s,
            spec.max_wait_s,
            spec.retry.poison_window_s,
            by.book.limits_of(spec.queue),
            by.defaults,
            f"body.{field(i)}",
            spec.resources.disk_mb,
        )
        for i, spec in enumerate(specs)
    ]


def check_placements(specs: Sequence[TaskCreate], field: Callable[[int], str]) -> None:
    """Each placement's selectors parsed (``domain.selectors``) and each service's ports
    and probes checked (``domain.services``): a 422 naming the field
    (``body.tasks.3.placement.required.0``) and the reason when one is not."""
    for i, spec in enumerate(specs):
        if spec.placement is not None:
            doc = spec.placement.model_dump(mode="json")
            selectors.rules_of(doc, f"body.{field(i)}placement")
        if spec.service is not None:
            service = spec.service.model_dump(mode="json")
            service_rules.check(service, spec.kind, f"body.{field(i)}service")


async def submit(
    by: Submitter,
    owners: str | list[str],
    specs: list[TaskCreate],
    field: Callable[[int], str],
    headers: Mapping[str, str],
    start_ns: int,
) -> list[tuple[Any, bool]]:
    """Store ``specs`` (all, or none), each owned by ``owners`` (one, or one per task):
    the owners' rights to their teams and secrets checked (``field(i)`` prefixes a
    refusal's field), their submission quotas admitted, then the notifier, the metrics
    and the traces told of what is new. Each row with whether it was created (False: its
    idempotency key matched a task). One task that no quota limits and that names no
    secret goes to the group commit (``by.group``), in one statement and one commit with
    the others of this moment; else one task is one statement with no transaction around
    it (autocommit saves two round trips). Time limits are filled in (or refused)
    first: ``fill_limits``. Work a service submits for a disabled owner is refused
    (``refuse_for_others``)."""
    filled = fill_limits(by, specs, field)
    check_placements(specs, field)
    each = [owners] * len(specs) if isinstance(owners, str) else owners
    await refuse_for_others(by, owners, each)
    team_of = [spec.team for spec in specs]
    limited = by.book.limits_submissions(each, team_of)
    told = False
    if (
        by.group is not None
        and len(specs) == 1
        and not limited
        and not secrets.needs_check(specs[0])
    ):
        [doc] = tasks_db.submission_docs(owners, specs, filled)
        # Told to the other replicas by its commit, before its row says whether it is
        # new (an idempotent repeat may wake a claim for nothing; it goes back to wait).
        work = _work_of(spec for spec in specs if spec.run_at is None or spec.run_at <= _soon())
        rows = [await by.group.submit(doc, work)]
        told = by.group.told
    else:
        rows = await _submit_alone(by, owners, specs, filled, field, limited)
    created = [(row, spec) for spec, (row, new) in zip(specs, rows, strict=True) if new]
    if created:
        soon = _soon()
        claimable = [
            spec
            for row, spec in created
            if row.state == TaskState.WAITING
            or (row.state == TaskState.READY and row.run_at <= soon)
        ]
        by.notifier.announce(_work_of(claimable), told=told)
        delayed = [row.run_at for row, _ in created if row.state == TaskState.READY]
        if delayed:
            by.notifier.announce_due(min(delayed))
        by.meter.submitted_to(spec.queue for _, spec in created)
        traces.submitted(headers, created, start_ns)
    return rows


async def refuse_for_others(by: Submitter, owners: str | list[str], each: list[str]) -> None:
    """A 403 naming the owner when a service submits for a disabled one (a cron fire, a
    workflow's node); the caller's own work needs no look: its credential was refused."""
    if all(owner == by.principal.name for owner in each):
        return

    def where(i: int) -> str:
        return f"header.{ON_BEHALF_OF}" if isinstance(owners, str) else f"body.owners.{i}"

    if by.disabled is not None:
        await by.disabled.refuse(by.engine, each, where)
        return
    async with by.engine.connect() as conn:
        await principals.refuse_disabled(conn, each, where)


def _soon() -> datetime:
    """Due before this, a task is claimable now (a claim leases ahead)."""
    return datetime.now(UTC) + timedelta(seconds=MAX_AHEAD_S)


def _work_of(specs: Iterable[TaskCreate]) -> Work:
    """The wake-ups these claimable submissions are worth: one per task in its queue; a
    task that requires labels wakes a claim whose worker matches them."""
    queues: dict[str, int] = {}
    placed = []
    for spec in specs:
        rule = tasks_db.required_of(spec)
        if rule is None:
            queues[spec.queue] = queues.get(spec.queue, 0) + 1
        else:
            placed.append((spec.queue, rule))
    return Work(queues=queues, placed=tuple(placed))


async def _submit_alone(
    by: Submitter,
    owners: str | list[str],
    specs: list[TaskCreate],
    filled: list[limits.Filled],
    field: Callable[[int], str],
    limited: bool,
) -> list[tuple[Any, bool]]:
    """``specs`` in one transaction: the owners' teams and secrets checked, their quotas
    admitted, then the rows. Unlimited, the rows' one statement is all or nothing by
    itself, so it runs in autocommit (no BEGIN and COMMIT: two round trips less, each a
    wait for core's loop at a burst: batches 26,824-28,072 -> 31,588-32,253 tasks/s,
    docs/benchmarks.md), unless a batch names idempotency keys (one that matches a
    different request refuses the whole batch after the statement) or secrets (their
    checks may record an owner's teams, kept only with the rows)."""
    each = [owners] * len(specs) if isinstance(owners, str) else owners
    checked = [secrets.needs_check(spec) for spec in specs]
    keyed = any(spec.idempotency_key for spec in specs)
    alone = len(specs) == 1 or not (keyed or any(checked))
    async with by.engine.connect() as conn:
        if alone and not limited:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
        async with conn.begin():
            for i, spec in enumerate(specs):
                if checked[i]:
                    await check_owner(conn, by.principal, each[i], spec, field(i))
            if limited:
                await _admit(conn, by.book, each, by.meter, [spec.team for spec in specs])
            return await tasks_db.submit(conn, owners, specs, by.quantum, filled, by.fair)


# --- one task ----------------------------------------------------------------------------


async def _audit_others(
    record: Auditor,
    conn: AsyncConnection,
    principal: Principal,
    action: str,
    before: Task,
    after: Task,
) -> None:
    """Acting on another owner's work (as an admin or a teammate) is audited; services
    act for the owner (cron, DAG) and are not."""
    if before.owner != principal.name and principal.role != "service":
        await record(
            conn,
            action,
            f"task:{before.id}",
            before={"owner": before.owner, "team": before.team, "state": before.state},
            after={"state": after.state},
        )


async def cancel(
    engine: AsyncEngine,
    notifier: Notifier,
    meter: CoreMetrics,
    principal: Principal,
    record: Auditor,
    task_id: int,
) -> Task:
    """Cancel a task the principal may see that has not finished (409 for a final one)."""
    async with engine.begin() as conn:
        before = await tasks_db.get_task(conn, task_id, principal.visibility)
        await tasks_db.cancel(conn, task_id, None, f"cancelled by {principal.name}")
        task = await tasks_db.get_task(conn, task_id, None)
        await _audit_others(record, conn, principal, "task.cancel", before, task)
    # A running task's end may release a limit that held other work back.
    notifier.announce(Work(sweep=before.state == TaskState.RUNNING))
    meter.ended(TaskState.CANCELLED)
    return task


async def retry(
    engine: AsyncEngine,
    notifier: Notifier,
    book: sharing.Book,
    principal: Principal,
    record: Auditor,
    task_id: int,
) -> Task:
    """Put a task the principal may see back in line, if ``may_retry`` allows it."""
    async with engine.begin() as conn:
        before = await tasks_db.get_task(conn, task_id, principal.visibility)
        await may_retry(conn, book, principal, before)
        await tasks_db.retry(conn, task_id, None)
        task = await tasks_db.get_task(conn, task_id, None)
        await _audit_others(record, conn, principal, "task.retry", before, task)
    notifier.announce(Work(queues={task.queue: 1}))
    return task


# --- in bulk -----------------------------------------------------------------------------

_BULK_PAGE = 500


@dataclass
class _Walk:
    """How far a bulk action got: moved, the last id passed, and what it refused."""

    changed: int = 0
    after: int = 0
    refused: int = 0
    refusal: str | None = None


Vet = Callable[[AsyncConnection, Task], Awaitable[str | None]]


async def _bulk_page(
    conn: AsyncConnection,
    op: Op,
    action: BulkAction,
    owner: str | None,
    walk: _Walk,
    limit: int,
    reason: str,
    vet: Vet | None,
) -> bool:
    """Move one page of the selection, leaving out what ``vet`` refuses; False at its end."""
    ids: list[int] | None = None
    if vet is not None:
        page = await tasks_db.selected_page(conn, op, action.filter, owner, walk.after, limit)
        if not page:
            return False
        ids = []
        for task in page:
            why = await vet(conn, task)
            if why is None:
                ids.append(task.id)
            else:
                walk.refused += 1
                walk.refusal = walk.refusal or f"task {task.id}: {why}"
    moved, last = await tasks_db.bulk_move(
        conn, op, action.filter, owner, after=walk.after, limit=limit, reason=reason, ids=ids
    )
    walk.changed += moved
    if ids is None:
        walk.after = last
        return moved > 0
    walk.after = page[-1].id
    return True


async def _bulk(
    engine: AsyncEngine,
    op: Op,
    action: BulkAction,
    principal: Principal,
    owner: str | None,
    reason: str,
    record: Auditor,
    vet: Vet | None = None,
) -> BulkResult:
    async with engine.connect() as conn:
        matched = await tasks_db.count_selected(conn, op, action.filter, owner, MAX_BULK_COUNT)
    if action.dry_run:
        return BulkResult(matched=matched, changed=0, dry_run=True, more=matched > 0)
    walk = _Walk()
    # Refused tasks are passed over, not moved: the walk stops after as many as a count.
    while walk.changed < action.limit and walk.refused < MAX_BULK_COUNT:
        # Each page its own short transaction: locks are held for a page, never a call.
        async with engine.begin() as conn:
            size = min(_BULK_PAGE, action.limit - walk.changed)
            if not await _bulk_page(conn, op, action, owner, walk, size, reason, vet):
                break
    if walk.refusal is not None and not walk.changed:
        raise Forbidden(walk.refusal)
    async with engine.begin() as conn:
        left = await tasks_db.count_selected(conn, op, action.filter, owner, walk.refused + 1)
        if walk.changed and owner != principal.name and principal.role != "service":
            # Beyond the caller's own tasks (an admin's, a team's): one row per call.
            await record(
                conn,
                f"task.bulk.{op.value}",
                f"team:{action.filter.team}" if action.filter.team else f"owner:{owner or '*'}",
                before={"filter": action.filter.model_dump(mode="json", exclude_defaults=True)},
                after={"changed": walk.changed},
            )
    return BulkResult(
        matched=matched,
        changed=walk.changed,
        dry_run=False,
        more=left > walk.refused,
        refused=walk.refused,
        refusal=walk.refusal,
    )


async def retry_many(
    engine: AsyncEngine,
    notifier: Notifier,
    book: sharing.Book,
    principal: Principal,
    owner: str | None,
    action: BulkAction,
    record: Auditor,
) -> BulkResult:
    """Retry what ``action`` selects of ``owner``'s (None: anyone's), page by page,
    passing over (and counting) what ``may_retry`` refuses; 403 when every one was."""

    async def vet(conn: AsyncConnection, task: Task) -> str | None:
        try:
            await may_retry(conn, book, principal, task)
        except (Forbidden, InvalidInput) as refused:
            return str(refused)
        return None

    reason = f"retried in bulk by {principal.name}"
    result = await _bulk(engine, Op.RETRY, action, principal, owner, reason, record, vet)
    if result.changed:
        notifier.announce(Work(any=result.changed))
    return result


async def cancel_many(
    engine: AsyncEngine,
    notifier: Notifier,
    meter: CoreMetrics,
    principal: Principal,
    owner: str | None,
    action: BulkAction,
    record: Auditor,
) -> BulkResult:
    """Cancel what ``action`` selects of ``owner``'s (None: anyone's), page by page."""
    reason = f"cancelled in bulk by {principal.name}"
    result = await _bulk(engine, Op.CANCEL, action, principal, owner, reason, record)
    if result.changed:
        notifier.announce(Work(sweep=True))
        meter.ended(TaskState.CANCELLED, result.changed)
    return result
