"""Cron's and dag's client of several cores (``CAIRN_CORE_URLS``) with one core hung: it
takes the connection (the kernel's backlog) and never answers, as a frozen process or
container does. A POST that timed out there is not sent again (it may have reached it),
but the next call goes to the other core, which answers: the caller's retry, under its
idempotency key, is not held on the hung one."""

from __future__ import annotations

import asyncio
import socket

import httpx
import psycopg
import pytest

from libs.common.client import CoreClient
from libs.common.models import TaskCreate
from libs.common.settings import libpq_url
from tests.support import Core, spec


def test_after_a_post_times_out_on_a_hung_core_the_next_call_goes_to_the_other(
    core: Core,
) -> None:
    token = core.token("cron", "service")
    task = TaskCreate.model_validate(spec(name="fired", idempotency_key="sched-1@0"))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections complete in the backlog; nothing ever answers
        hung = f"http://127.0.0.1:{silent.getsockname()[1]}"

        async def fire() -> bool:
            # The live core's first answers (its pool's connections, the token's check)
            # are had before: under a loaded CI they took past the 1 s meant for the hung.
            with core.client("cron", "service") as warm:
                assert warm.get("/v1/whoami").status_code == 200
            timeout = httpx.Timeout(2.0, connect=1.0)
            async with CoreClient([hung, core.url], token, timeout=timeout) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.submit(task)  # to the hung core: not sent again
                _, created = await client.submit(task)  # the caller's retry
                return created

        created = asyncio.run(fire())
    assert created
    with psycopg.connect(libpq_url(core.db_url)) as conn:
        rows = conn.execute(
            "SELECT owner, name FROM core.tasks WHERE idempotency_key = 'sched-1@0'"
        ).fetchall()
    assert rows == [("cron", "fired")]
