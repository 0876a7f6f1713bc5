"""Waits that a stop always ends, for every service's loops.

A service stops its loops by cancelling their tasks and waiting for them. On Python 3.11
``asyncio.wait_for`` loses such a cancel when what it waits on completes in the same pass
of the event loop (it returns the result instead: CPython gh-86296, fixed in 3.12): a loop
that sleeps with ``wait_for(event.wait(), timeout)`` and is woken as it is stopped turns
on, and whatever waits for it to end waits for good. A replica then did not stop on
SIGTERM, and a test's server did not stop until its join gave up.

``woken`` is that sleep without the loss; ``stop`` cancels tasks and waits for them,
cancelling again those that lost a cancel all the same (any library may swallow one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger("cairn.waits")

#: how long a stopped task has to end before it is cancelled again
AGAIN_S = 0.5
#: how long ``stop`` waits in all before it leaves a task that will not end (logged)
STOP_BOUND_S = 20.0


async def woken(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether ``event`` is set within ``timeout`` seconds (None: no bound). Unlike
    ``asyncio.wait_for(event.wait(), timeout)``, a cancel is never lost."""
    if event.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


async def stop(*tasks: asyncio.Task[Any], bound_s: float = STOP_BOUND_S) -> None:
    """Cancel ``tasks`` and wait until they have ended, cancelling again every
    ``AGAIN_S`` those still running. Past ``bound_s`` the ones still running are logged
    with where they wait, and left. What the tasks raised is theirs (it is not raised
    here); a cancel of the caller waits for the stop, then is raised."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    running = {task for task in tasks if not task.done()}
    cancelled: asyncio.CancelledError | None = None
    while running:
        for task in running:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            _left_running(running, bound_s)
            break
        try:
            _, running = await asyncio.wait(running, timeout=min(AGAIN_S, left))
        except asyncio.CancelledError as exc:
            cancelled = exc  # the tasks were told; they still have to end
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # seen: not reported again as never retrieved
    if cancelled is not None:
        raise cancelled


def _left_running(running: set[asyncio.Task[Any]], bound_s: float) -> None:
    for task in running:
        log.error(
            "task %s did not end %.0f s after it was stopped; left running:\n%s",
            task.get_name(),
            bound_s,
            awaiting(task),
        )


def awaiting(task: asyncio.Task[Any]) -> str:
    """Where ``task`` waits: each coroutine down its chain of awaits, innermost last
    (``Task.print_stack`` shows only the outermost of a suspended task)."""
    lines = [f"task {task.get_name()}:\n"]
    step: Any = task.get_coro()
    while step is not None:
        frame = getattr(step, "cr_frame", None) or getattr(step, "ag_frame", None)
        frame = frame or getattr(step, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n')
        step = next(
            (n for a in ("cr_await", "ag_await", "gi_yieldfrom") if (n := getattr(step, a, None))),
            None,
        )
    return "".join(lines)
