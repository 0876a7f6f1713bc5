"""One write per HTTP message on a connection, both ways.

uvicorn writes a response's head and its body in two ``transport.write`` calls, and
httpcore a request's head and its body in two socket writes: each a system call, a TCP
segment and, on loopback, a wake-up of the peer, which reads the head alone and waits
again for the body (uvicorn starts the request's task on its head, which then waits for
its body). A worker agent's turn paid four of each where two do. Here writes are held
and sent together: a server's until the end of the loop's pass (``Corked``, in ``serve``), a
client's until it reads the answer (``cork``)."""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
from typing import Any

import httpcore
import httpx

#: held bytes past this are written at once (a long streamed body is not held whole)
HELD_MAX = 64 * 1024


class Corked:
    """A transport whose writes of one pass of the loop go out as one."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self._size = 0
        self._flush_soon: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._held.append(bytes(data))
        self._size += len(data)
        if self._size >= HELD_MAX:
            self.flush()
        elif self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self.flush)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held, self._size = [], 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._size + self._transport.get_write_buffer_size()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held, self._size = [], 0
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HeldStream(httpcore.AsyncNetworkStream):
    """A client's stream that holds what it writes until it reads (a request's head and
    body, then the answer). httpcore waits for an answer only by reading (HTTP/1.1:
    ``_receive_event``), so nothing held is left behind while it waits; what is held goes
    out within the timeout it was written with (the request's write timeout), not the
    read's: a long poll's read timeout (``httpx.Timeout(5, read=60)``) is no bound on a
    stalled write of its request."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._held: list[bytes] = []
        self._size = 0
        self._timeout: float | None = None  # the write timeout of what is held
        # asked for "is_readable" before each reuse of the connection: anyio builds its
        # table of attributes on every ask, so the socket is looked up once
        self._socket = stream.get_extra_info("socket")

    async def _flush(self, timeout: float | None) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held, self._size = [], 0
            await self._stream.write(data, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._held.append(buffer)
        self._size += len(buffer)
        self._timeout = timeout
        if self._size >= HELD_MAX:
            await self._flush(timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._flush(self._timeout)
        return await self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._held, self._size = [], 0
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        await self._flush(self._timeout)
        return _HeldStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and self._socket is not None:
            return _readable(self._socket)
        return self._stream.get_extra_info(info)


def _readable(sock: socket.socket) -> bool:
    """Whether a read would not wait (data, or the peer's close), as httpcore asks of an
    idle connection before it reuses it; a closed socket counts as readable, as there."""
    fd = sock.fileno()
    if fd < 0:
        return True
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class _HeldBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _HeldStream(await self._backend.connect_tcp(*args, **kwargs))

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _HeldStream(await self._backend.connect_unix_socket(*args, **kwargs))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def cork(client: httpx.AsyncClient) -> httpx.AsyncClient:
    """``client`` sending each request in one write, through its own transport (the one
    it built, proxies from the environment kept as mounts). A transport given to it, or
    a pool of another kind, is left as it is."""
    transport = client._transport
    if type(transport) is httpx.AsyncHTTPTransport:
        pool = transport._pool
        if type(pool) is httpcore.AsyncConnectionPool:
            pool._network_backend = _HeldBackend(pool._network_backend)
    return client
