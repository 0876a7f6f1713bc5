"""The event feed other services consume: ordered, lossless, long-polling."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

from fastapi import APIRouter, Query, Request

from libs.common.errors import InvalidInput
from libs.common.models import MAX_PAGE, MAX_WAIT_S, Event, EventPage
from libs.common.problems import PROBLEMS
from libs.common.states import FINAL
from services.core.api.deps import Engine, Reader
from services.core.db import tasks as tasks_db
from services.core.db.feed import Notifier

router = APIRouter(prefix="/v1/events", tags=["events"])

_CURSOR = re.compile(r"^(\d{1,19})\.(\d{1,19})$")
_MAX = 2**63 - 1
_POLL_S = 0.5


def parse_cursor(after: str) -> tuple[int, int]:
    match = _CURSOR.match(after)
    if not match or int(match[1]) > _MAX or int(match[2]) > _MAX:
        raise InvalidInput("after: not a cursor this API gave out (use 0.0 to start)")
    return int(match[1]), int(match[2])


@router.get("", response_model=EventPage, responses=PROBLEMS)
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
) -> EventPage:
    """Events after ``after``, oldest first. With ``wait``, an empty answer is held until
    an event arrives or ``wait`` seconds pass. With ``hold`` too, a page none of whose
    events moved a task to a final state is held up to ``hold`` seconds more (within
    ``wait``) and answered, with what came meanwhile, as soon as one does: a follower
    that acts on ends (the DAG service) is answered once a short task, not at its
    creation, its start and its end. Users read the events of their own tasks and of
    their teams' tasks; admins and services every task's."""
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
