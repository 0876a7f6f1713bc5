"""/readyz fails while a service's background loop has ended, naming the loop (so that a
container health check sees a service that answers but no longer works)."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from libs.common import health


async def _readyz(loops: dict[str, asyncio.Task[None]]) -> httpx.Response:
    app = FastAPI()
    app.include_router(health.router)
    app.state.loops = loops
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
        return await client.get("/readyz")


def test_a_stopped_loop_makes_the_service_unready() -> None:
    async def scenario() -> httpx.Response:
        async def ends() -> None:
            return None

        async def runs() -> None:
            await asyncio.sleep(60)

        ended = asyncio.create_task(ends())
        await ended
        running = asyncio.create_task(runs())
        try:
            return await _readyz({"cron-engine": ended, "cron-watch": running})
        finally:
            running.cancel()

    answer = asyncio.run(scenario())
    assert answer.status_code == 503
    assert answer.json() == {"status": "unavailable", "detail": "stopped: cron-engine"}
