"""The event feed other services consume: ordered, lossless, long-polling."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

from fastapi import APIRouter, Query, Request

from libs.common.errors import InvalidInput
from libs.common.models import MAX_PAGE, MAX_WAIT_S, EventPage
from libs.common.problems import PROBLEMS
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
) -> EventPage:
    """Events after ``after``, oldest first. With ``wait``, an empty answer is held until
    an event arrives or ``wait`` seconds pass. Users read the events of their own tasks
    and of their teams' tasks; admins and services every task's."""
    cursor = parse_cursor(after)
    notifier: Notifier = request.app.state.notifier
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        since = notifier.mark()  # an event committed after this read wakes the wait
        async with engine.connect() as conn:
            # One statement, with its own snapshot: no BEGIN before it, no ROLLBACK after
            # (two round trips of each read saved; a workflow hop waits on this one).
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            events, next_cursor = await tasks_db.read_feed(
                conn, cursor, limit, principal.visibility
            )
        remaining = deadline - asyncio.get_running_loop().time()
        if events or remaining <= 0 or await request.is_disconnected():
            return EventPage(items=events, next_cursor=f"{next_cursor[0]}.{next_cursor[1]}")
        cursor = next_cursor
        await notifier.wait(min(remaining, _POLL_S), since)
