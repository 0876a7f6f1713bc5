"""One write per HTTP answer on a connection.

uvicorn writes a response's head and its body in two ``transport.write`` calls: each a
system call, a TCP segment and, on loopback, a wake-up of the peer, which reads the head
alone and waits again for the body. Here a server's writes are held and sent together
until the end of the loop's pass (``Corked``, in ``serve``). The client's side, a
request's head and body in one write, is its transport's (``libs/common/transport.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

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
