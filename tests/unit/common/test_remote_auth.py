"""RemoteAuth: how cron and DAG learn who calls them, against a mocked core."""

from __future__ import annotations

import asyncio
import contextlib

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


class Core(httpx.AsyncBaseTransport):
    """Core's whoami, answering only once ``release`` is set, counting what it is asked
    and how often the client that holds it is closed."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.release = asyncio.Event()
        self.asked: list[str] = []
        self.closes = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(request.headers["Authorization"])
        await self.release.wait()
        if self.status == 401:
            body = {"type": "https://cairn.dev/problems/unauthorized", "detail": "revoked"}
            return httpx.Response(401, json=body)
        return httpx.Response(200, json={"name": "alice", "role": "user"})

    async def aclose(self) -> None:
        self.closes += 1


async def _burst(auth: RemoteAuth, core: Core, token: str, n: int) -> list[object]:
    calls = [asyncio.ensure_future(auth.resolve(token)) for _ in range(n)]
    await asyncio.sleep(0.01)  # every resolve is waiting on core now
    core.release.set()
    return await asyncio.gather(*calls, return_exceptions=True)


def test_a_burst_of_one_uncached_token_asks_core_once() -> None:
    core = Core()
    auth = RemoteAuth(CORE, ttl_s=60, transport=core)

    async def burst() -> list[object]:
        return await _burst(auth, core, "t1", 50)

    answers = asyncio.run(burst())
    assert core.asked == ["Bearer t1"]
    assert {a.name for a in answers} == {"alice"}  # type: ignore[attr-defined]
    assert auth._asking == {}


def test_a_refused_token_is_refused_to_every_waiter_and_not_kept() -> None:
    core = Core(status=401)
    auth = RemoteAuth(CORE, ttl_s=60, transport=core)

    async def burst_then_again() -> tuple[list[object], BaseException | None]:
        answers = await _burst(auth, core, "bad", 20)
        try:
            await auth.resolve("bad")
        except Unauthorized as exc:
            return answers, exc
        return answers, None

    answers, again = asyncio.run(burst_then_again())
    assert all(isinstance(a, Unauthorized) for a in answers)
    assert isinstance(again, Unauthorized)
    assert core.asked == ["Bearer bad", "Bearer bad"]  # the burst once, then again
    assert auth._asking == {}
    assert len(auth._kept) == 0


def test_a_waiter_that_goes_away_does_not_cancel_the_others() -> None:
    core = Core()
    auth = RemoteAuth(CORE, ttl_s=60, transport=core)

    async def one_leaves() -> str:
        first = asyncio.ensure_future(auth.resolve("t"))
        second = asyncio.ensure_future(auth.resolve("t"))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0)
        core.release.set()
        return (await second).name

    assert asyncio.run(one_leaves()) == "alice"
    assert len(core.asked) == 1


def test_calls_under_way_are_bounded() -> None:
    core = Core()
    auth = RemoteAuth(CORE, ttl_s=60, size=2, transport=core)

    async def five_tokens() -> tuple[int, list[object]]:
        calls = [asyncio.ensure_future(auth.resolve(f"t{i}")) for i in range(5)]
        await asyncio.sleep(0.01)
        under_way = len(auth._asking)
        core.release.set()
        return under_way, await asyncio.gather(*calls)

    under_way, answers = asyncio.run(five_tokens())
    assert under_way == 2
    assert len(answers) == 5
    assert sorted(core.asked) == [f"Bearer t{i}" for i in range(5)]


def test_one_client_serves_every_check_until_closed() -> None:
    core = Core()
    core.release.set()
    auth = RemoteAuth(CORE, ttl_s=60, transport=core)

    async def many() -> int:
        for i in range(10):
            await auth.resolve(f"t{i}")
        closes_before = core.closes
        await auth.aclose()
        return closes_before

    assert asyncio.run(many()) == 0  # the client (and its pool) lived through 10 checks
    assert core.closes == 1
    assert auth.closed
    assert core.asked == [f"Bearer t{i}" for i in range(10)]


def test_checks_share_one_keep_alive_connection() -> None:
    """Against a real HTTP/1.1 server on loopback: ten checks, one TCP connection."""
    accepted = 0
    hung_up = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        body = b'{"name": "alice", "role": "user"}'
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(head + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        writer.close()
        await writer.wait_closed()
        hung_up.set()

    async def checks() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        auth = RemoteAuth(f"http://127.0.0.1:{port}", ttl_s=60)
        try:
            for i in range(10):
                assert (await auth.resolve(f"t{i}")).name == "alice"
        finally:
            await auth.aclose()
            await asyncio.wait_for(hung_up.wait(), 5)
            server.close()
            await server.wait_closed()

    asyncio.run(checks())
    assert accepted == 1


@pytest.mark.parametrize("service", ["cron", "dag"])
def test_the_service_closes_its_token_checker_when_it_stops(service: str) -> None:
    unused = "postgresql://cairn@127.0.0.1:1/unused"  # the lifespan opens no connection
    if service == "cron":
        from services.cron.app import create_app as cron_app
        from services.cron.settings import CronSettings

        app = cron_app(CronSettings(database_url=unused), unused, engine=False)
    else:
        from services.dag.app import create_app as dag_app
        from services.dag.settings import DagSettings

        app = dag_app(DagSettings(database_url=unused), unused)

    async def start_stop() -> RemoteAuth:
        async with app.router.lifespan_context(app):
            auth: RemoteAuth = app.state.auth
            assert not auth.closed
        return auth

    assert asyncio.run(start_stop()).closed


@pytest.mark.parametrize(("timeout_s", "resolved"), [(0.1, False), (3.0, True)])
def test_a_check_waits_its_timeout_for_core(timeout_s: float, resolved: bool) -> None:
    """Against a real server on loopback that answers after 0.5 s: a check that waits
    0.1 s is a 503 naming the read timeout; one that waits 3 s resolves."""
    served = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b'{"name": "alice", "role": "user"}'
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(0.5)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        served.set()

    async def check() -> str:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        auth = RemoteAuth(f"http://127.0.0.1:{port}", timeout_s=timeout_s)
        try:
            return (await auth.resolve("t")).name
        finally:
            await auth.aclose()
            await asyncio.wait_for(served.wait(), 5)
            server.close()
            await server.wait_closed()

    if resolved:
        assert asyncio.run(check()) == "alice"
    else:
        with pytest.raises(Unavailable, match="ReadTimeout"):
            asyncio.run(check())


OTHER = "http://core-2.test"
ALICE = httpx.Response(200, json={"name": "alice", "role": "user"})


@respx.mock
def test_a_core_that_answers_5xx_passes_the_check_to_the_next() -> None:
    failing = respx.get(f"{CORE}/v1/whoami").mock(return_value=httpx.Response(502))
    respx.get(f"{OTHER}/v1/whoami").mock(return_value=ALICE)
    caller = asyncio.run(RemoteAuth([CORE, OTHER], ttl_s=0).resolve("t"))
    assert caller.name == "alice"
    assert failing.call_count == 1


@respx.mock
def test_a_401_from_a_core_that_answered_is_final() -> None:
    revoked = {"type": "https://cairn.dev/problems/unauthorized", "detail": "revoked"}
    respx.get(f"{CORE}/v1/whoami").mock(return_value=httpx.Response(401, json=revoked))
    other = respx.get(f"{OTHER}/v1/whoami").mock(return_value=ALICE)
    with pytest.raises(Unauthorized):
        asyncio.run(RemoteAuth([CORE, OTHER]).resolve("t"))
    assert other.call_count == 0
