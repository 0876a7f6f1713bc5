"""Sharing one pool: owners' shares, quotas and use; queue policies; concurrency keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from libs.common.errors import NotFound
from libs.common.models import (
    ConcurrencyKeyName,
    ConcurrencyLimit,
    ConcurrencyState,
    Name,
    OwnerList,
    OwnerUsage,
    QueueName,
    QueuePolicy,
    ShareSettings,
)
from libs.common.problems import PROBLEMS
from libs.common.stored import Stored
from services.core.api.deps import AdminOnly, Audit, BacklogCounts, Engine, Reader, aged
from services.core.db import sharing
from services.core.ops import sharing as sharing_ops

router = APIRouter(tags=["sharing"])

OwnerName = Annotated[Name, Path(description="The owner (a principal's name).")]
KeyPath = Annotated[ConcurrencyKeyName, Path(description="The concurrency key.")]


def _book(request: Request) -> sharing.Book:
    book: sharing.Book = request.app.state.sharing
    return book


@router.get("/v1/owners", response_model=OwnerList, responses=PROBLEMS)
async def top_owners(
    request: Request,
    principal: Reader,
    engine: Engine,
    response: Response,
    read: BacklogCounts,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> OwnerList:
    """The owners with the most work running and waiting (users see only themselves and
    their teams). Which owners those are, and the flows their shares are among, count the
    whole backlog, once for all of this core's callers at a time: with
    `Cache-Control: max-age=N` a request may get a count up to N seconds old (the `Age`
    header says how old); without it, one counted after it came."""
    half_life = _half_life(request)
    # the backlog's counts first, before a connection of its own (db.readings)
    if principal.owner_filter is not None:
        active = await sharing.active_flows(read)
        async with engine.connect() as conn:
            teams = sorted(principal.teams)
            items = await sharing.caller_usage(conn, principal.name, teams, half_life, active)
    else:
        top = await sharing.top_counts(read, limit)
        async with engine.connect() as conn:
            items = await sharing.top_owners(conn, top, half_life)
    aged(response, read)
    return OwnerList(items=items)


def _half_life(request: Request) -> float:
    """Fair share's half-life (``CAIRN_FAIR_SHARE_HALF_LIFE_S``), for decayed usage."""
    return float(request.app.state.settings.fair_share_half_life_s)


@router.get("/v1/owners/{name}/usage", response_model=OwnerUsage, responses=PROBLEMS)
async def owner_usage(
    request: Request, name: OwnerName, principal: Reader, engine: Engine
) -> OwnerUsage:
    """The owner's weight and share of the pool, what it runs (attempts, CPU, memory
    requested), how much waits, its quotas and which of them it is at, and the decayed
    core-seconds fair share by usage weighs. Users read their own (another's is a 404)."""
    if principal.owner_filter is not None and name != principal.name:
        raise NotFound(f"owner {name} not found")
    async with engine.connect() as conn:
        [usage] = await sharing.usage_of(conn, [name], _half_life(request))
    return usage


@router.patch("/v1/owners/{name}/share", response_model=OwnerUsage, responses=PROBLEMS)
async def set_share(
    name: OwnerName,
    change: ShareSettings,
    principal: AdminOnly,
    engine: Engine,
    request: Request,
    record: Audit,
) -> OwnerUsage:
    """Set the owner's fair-share weight and quotas (null: no limit; weight null: 1)."""
    return await sharing_ops.set_share(engine, record, _book(request), name, change)


@router.get("/v1/queues/{name}/policy", response_model=Stored[QueuePolicy], responses=PROBLEMS)
async def get_policy(name: QueueName, principal: Reader, engine: Engine) -> QueuePolicy:
    """What submitters may ask for in the queue (everything, when no policy is set)."""
    async with engine.connect() as conn:
        return await sharing.get_policy(conn, name) or QueuePolicy()


@router.put("/v1/queues/{name}/policy", response_model=Stored[QueuePolicy], responses=PROBLEMS)
async def set_policy(
    name: QueueName,
    policy: QueuePolicy,
    principal: AdminOnly,
    engine: Engine,
    request: Request,
    record: Audit,
) -> QueuePolicy:
    """Replace the queue's policy: priority range per role, whether users may submit
    services or guaranteed (non-preemptible) work, which owners may use it."""
    return await sharing_ops.set_policy(engine, record, _book(request), name, policy)


@router.get("/v1/concurrency/{key}", response_model=ConcurrencyState, responses=PROBLEMS)
async def get_key(key: KeyPath, principal: Reader, engine: Engine) -> ConcurrencyState:
    """The key's limits (an admin's) and its attempts running and started in the window."""
    async with engine.connect() as conn:
        return await sharing.key_state(conn, key)


@router.put("/v1/concurrency/{key}", response_model=ConcurrencyState, responses=PROBLEMS)
async def set_key(
    key: KeyPath, limit: ConcurrencyLimit, principal: AdminOnly, engine: Engine, record: Audit
) -> ConcurrencyState:
    """Set the key's limits for the whole pool: at most ``max_running`` attempts at once,
    at most ``max_starts`` starts per ``window_s``. They override the tasks' own limit."""
    return await sharing_ops.set_key_limit(engine, record, key, limit)
