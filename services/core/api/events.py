"""The event feed other services consume: ordered, lossless, long-polling."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.errors import InvalidInput
from libs.common.models import MAX_PAGE, MAX_WAIT_S, Event, EventPage
from libs.common.problems import PROBLEMS
from libs.common.states import FINAL
from services.core.api.deps import (
    JSON,
    READERS,
    Engine,
    PlainRoute,
    Reader,
    engine_of,
    plain_caller,
)
from services.core.db import tasks as tasks_db
from services.core.db.feed import Notifier
from services.core.domain.principals import Principal

router = APIRouter(prefix="/v1/events", tags=["events"])

_CURSOR = re.compile(r"^(\d{1,19})\.(\d{1,19})$")
_MAX = 2**63 - 1
_POLL_S = 0.5


def parse_cursor(after: str) -> tuple[int, int]:
    match = _CURSOR.match(after)
    if not match or int(match[1]) > _MAX or int(match[2]) > _MAX:
        raise InvalidInput("after: not a cursor this API gave out (use 0.0 to start)")
    return int(match[1]), int(match[2])


async def read_events(
    request: Request,
    principal: Reader,
    engine: Engine,
    after: Annotated[str, Query(max_length=40, description="A cursor; 0.0 is the start")] = "0.0",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait")] = 0,
    hold: Annotated[
        float,
        Query(
            ge=0,
            le=MAX_WAIT_S,
            description="Seconds a page that ends no task is held for one that does",
        ),
    ] = 0,
) -> Response:
    """Events after ``after``, oldest first. With ``wait``, an empty answer is held until
    an event arrives or ``wait`` seconds pass. With ``hold`` too, a page none of whose
    events moved a task to a final state is held up to ``hold`` seconds more (within
    ``wait``) and answered, with what came meanwhile, as soon as one does: a follower
    that acts on ends (the DAG service) is answered once a short task, not at its
    creation, its start and its end. Users read the events of their own tasks and of
    their teams' tasks; admins and services every task's."""
    page = await _page(request, principal, engine, after, limit, wait, hold)
    return Response(page.model_dump_json(), media_type=JSON)


async def _page(
    request: Request,
    principal: Principal,
    engine: AsyncEngine,
    after: str,
    limit: int,
    wait: float,
    hold: float,
) -> EventPage:
    cursor = parse_cursor(after)
    notifier: Notifier = request.app.state.notifier
    clock = asyncio.get_running_loop()
    deadline = clock.time() + wait
    held: list[Event] = []
    until = deadline  # the answer is due then at the latest
    while True:
        since = notifier.mark()  # an event committed after this read wakes the wait
        async with engine.connect() as conn:
            # One statement, with its own snapshot: no BEGIN before it, no ROLLBACK after
            # (two round trips of each read saved; a workflow hop waits on this one).
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            events, cursor = await tasks_db.read_feed(
                conn, cursor, limit - len(held), principal.visibility
            )
        now = clock.time()
        if events and not held:
            until = min(deadline, now + hold)
        held += events
        if (
            (held and (len(held) >= limit or any(e.to_state in FINAL for e in events)))
            or now >= until
            or await request.is_disconnected()
        ):
            return EventPage(items=held, next_cursor=f"{cursor[0]}.{cursor[1]}")
        await notifier.wait(min(until - now, _POLL_S), since)


# What the plain path takes of the query as FastAPI would (anything else goes to it):
# a page size of plain digits, seconds as plain decimals.
_LIMIT = re.compile(r"[1-9][0-9]{0,3}")
_SECONDS = re.compile(r"(?:0|[1-9][0-9]{0,8})(?:\.[0-9]{1,9})?")


def _seconds(value: str | None) -> float | None:
    """``wait`` or ``hold`` as the query declares them (0 when absent), if plainly so."""
    if value is None:
        return 0.0
    if _SECONDS.fullmatch(value) is None or float(value) > MAX_WAIT_S:
        return None
    return float(value)


class FeedRoute(PlainRoute):
    """``GET /v1/events`` as ``read_events`` declares it, served without FastAPI's
    dependency solving and query validation (the DAG service's long poll, once a workflow
    hop): the caller authenticated first (401, 403 as there), then the query taken as
    the declaration takes it; a query it would not take as it is goes to FastAPI's own
    handler, so every refusal is the one it gives."""

    def takes(self, request: Request) -> bool:
        return True  # no body

    async def plain(self, request: Request) -> Response | None:
        principal = await plain_caller(request, READERS)
        query = request.query_params
        after, limit = query.get("after", "0.0"), query.get("limit")
        wait, hold = _seconds(query.get("wait")), _seconds(query.get("hold"))
        if (
            len(after) > 40
            or (limit is not None and _LIMIT.fullmatch(limit) is None)
            or (limit is not None and int(limit) > MAX_PAGE)
            or wait is None
            or hold is None
        ):
            return None
        size = 100 if limit is None else int(limit)
        page = await _page(request, principal, engine_of(request), after, size, wait, hold)
        return Response(page.model_dump_json(), media_type=JSON)


router.add_api_route(
    "",
    read_events,
    methods=["GET"],
    response_model=EventPage,
    responses=PROBLEMS,
    route_class_override=FeedRoute,
)
