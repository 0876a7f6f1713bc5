"""One write per HTTP answer (``libs/common/corked.py``): a server's writes of one pass
of the loop go out together; over real sockets, what the peer receives is the same
bytes."""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

import httpx
import uvicorn

from libs.common.client import CoreClient
from libs.common.corked import HELD_MAX, Corked
from libs.common.serve import CorkedHttpTools


class _Counted:
    """A real transport, or a real stream, counting the writes it is asked for."""

    def __init__(self, real: Any) -> None:
        self.real, self.writes, self.timeouts = real, [], []

    def write(self, data: bytes, *timeout: Any) -> Any:
        self.writes.append(bytes(data))
        self.timeouts.append(timeout[0] if timeout else None)
        return self.real.write(data, *timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def _pair() -> tuple[_Counted, socket.socket]:
    ours, theirs = socket.socketpair()
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, ours)
    theirs.setblocking(False)
    return _Counted(transport), theirs


async def _received(sock: socket.socket, size: int) -> bytes:
    loop, got = asyncio.get_running_loop(), b""
    while len(got) < size:
        got += await loop.sock_recv(sock, 1 << 20)
    return got


def test_a_servers_writes_of_one_pass_go_out_as_one() -> None:
    async def scenario() -> None:
        counted, peer = await _pair()
        corked = Corked(counted)  # type: ignore[arg-type]
        corked.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        corked.write(b"ok")
        assert counted.writes == []  # held until the pass ends
        await asyncio.sleep(0)
        assert counted.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
        assert await _received(peer, 40) == counted.writes[0]
        corked.write(b"bye")
        corked.close()  # what is held goes before the close
        assert counted.writes[-1] == b"bye" and counted.is_closing()
        peer.close()

    asyncio.run(scenario())


def test_a_long_body_is_not_held_whole_and_an_abort_drops_what_is_held() -> None:
    async def scenario() -> None:
        counted, peer = await _pair()
        corked = Corked(counted)  # type: ignore[arg-type]
        corked.write(b"x" * HELD_MAX)
        assert len(counted.writes) == 1  # at once
        corked.write(b"never")
        corked.abort()
        await asyncio.sleep(0)
        assert len(counted.writes) == 1
        peer.close()

    asyncio.run(scenario())


def test_a_corked_server_answers_as_before() -> None:
    """A real uvicorn with the corked protocol, answered through httpx's client and
    through Cairn's (its lean transport): heads, bodies and keep-alive as without it."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"echo:" + body})

    async def scenario() -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        config = uvicorn.Config(app, http=CorkedHttpTools, log_config=None, lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            answers = [(await http.post("/", content=f"{i}")).text for i in range(3)]
        assert answers == ["echo:0", "echo:1", "echo:2"]
        async with CoreClient(f"http://127.0.0.1:{port}", None) as client:
            answers = [(await client._call("POST", "/", content=f"{i}")).text for i in range(3)]
        assert answers == ["echo:0", "echo:1", "echo:2"]
        server.should_exit = True
        await serving

    asyncio.run(scenario())


def test_httpcore_finds_sniffio_so_no_request_pays_a_failed_import() -> None:
    """httpcore asks sniffio which async library runs at each lock, event and cancel
    shield of a request; without it installed (anyio no longer brings it) each ask is a
    failed import through the whole path, about 0.2 ms of CPU a request: pyproject.toml
    names it."""
    from httpcore._synchronization import current_async_library

    async def ask() -> str:
        return current_async_library()

    assert asyncio.run(ask()) == "asyncio"
    assert sys.modules.get("sniffio") is not None
