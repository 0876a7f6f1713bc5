"""A small HTTP/1.1 client for the benchmarks' load generators: keep-alive connections,
one request at a time each, bodies by Content-Length. httpx's client costs several
milliseconds of CPU a request at these rates, on the same two cores as what is measured;
this costs tens of microseconds."""

from __future__ import annotations

import asyncio
from typing import Any


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time; bodies by Content-Length."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay_s: float = 0.0) -> None:
        self.loop = loop
        #: a round trip added to every request, half each way (``netns.Hosts``)
        self.delay_s = delay_s
        self.transport: Any = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.head_end = -1
        self.need = -1
        self.status = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0 and not self._parse_head():
            return
        if len(self.buf) >= self.need:
            body = bytes(self.buf[self.head_end : self.need])
            del self.buf[: self.need]
            self.need = -1
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result((self.status, body))

    def _parse_head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self.buf[:end]).split(b"\r\n")
        self.status = int(lines[0].split(b" ", 2)[1])
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length is None:
            self._fail(ConnectionError("an answer without Content-Length"))
            return False
        self.head_end = end + 4
        self.need = self.head_end + length
        return True

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("connection closed"))

    async def request(self, data: bytes, timeout: float) -> tuple[int, bytes]:
        if self.closed:  # the server closed it (an idle keep-alive's timeout)
            raise ConnectionError("connection closed")
        if self.delay_s:
            await asyncio.sleep(self.delay_s / 2)
        self.waiter = self.loop.create_future()
        self.transport.write(data)
        answer = await asyncio.wait_for(self.waiter, timeout)
        if self.delay_s:
            await asyncio.sleep(self.delay_s / 2)
        return answer


def request_bytes(
    host: str,
    port: int,
    path: str,
    body: bytes,
    token: str | None,
    headers: dict[str, str] | None = None,
) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Accept: application/json",
    ]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
