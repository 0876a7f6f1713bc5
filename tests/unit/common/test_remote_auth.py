"""RemoteAuth: how cron and DAG learn who calls them, against a mocked core."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import respx

from libs.common.auth import RemoteAuth
from libs.common.errors import Unauthorized, Unavailable

CORE = "http://core.test"


@respx.mock
def test_a_known_token_resolves_and_is_cached() -> None:
    route = respx.get(f"{CORE}/v1/whoami").mock(
        return_value=httpx.Response(200, json={"name": "alice", "role": "user"})
    )
    auth = RemoteAuth(CORE, ttl_s=60)

    async def twice() -> None:
        first = await auth.resolve("t1")
        second = await auth.resolve("t1")
        assert first == second
        assert first.name == "alice"
        assert first.owner_filter == "alice"

    asyncio.run(twice())
    assert route.call_count == 1
    assert route.calls[0].request.headers["Authorization"] == "Bearer t1"


@respx.mock
def test_an_unknown_token_is_unauthorized() -> None:
    respx.get(f"{CORE}/v1/whoami").mock(
        return_value=httpx.Response(
            401,
            json={"type": "https://cairn.dev/problems/unauthorized", "detail": "revoked"},
        )
    )
    with pytest.raises(Unauthorized):
        asyncio.run(RemoteAuth(CORE).resolve("bad"))


@respx.mock
def test_core_unreachable_is_unavailable_not_unauthorized() -> None:
    respx.get(f"{CORE}/v1/whoami").mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(Unavailable) as refused:
        asyncio.run(RemoteAuth(CORE).resolve("t"))
    # The problem's title, one for every use of the type, is true of core too; the
    # detail says which service could not be reached.
    problem = refused.value.problem()
    assert problem["title"] == "Something this request needs is unavailable right now; try again."
    assert problem["detail"].startswith("core cannot be reached to check the token")


@respx.mock
def test_a_zero_ttl_asks_every_time() -> None:
    route = respx.get(f"{CORE}/v1/whoami").mock(
        return_value=httpx.Response(200, json={"name": "svc", "role": "service"})
    )
    auth = RemoteAuth(CORE, ttl_s=-1)

    async def twice() -> None:
        assert (await auth.resolve("t")).owner_filter is None
        await auth.resolve("t")

    asyncio.run(twice())
    assert route.call_count == 2
