"""An HTTP/1.1 proxy on 127.0.0.1 in front of core, for faults tests that need core's
answers lost or its requests late, as a network or a slow core would have them: one
request at a time per connection, each message with a Content-Length (the agent's
requests and core's answers all have one). Subclasses say what happens on the way."""

from __future__ import annotations

import asyncio

from tests.support.loopserver import LoopServer

MAX_HEAD = 64 * 1024


class Proxy(LoopServer):
    """Passes every request to core at ``backend`` and its answer back, unless ``answer``
    answers it itself, ``hold`` delays the request, ``drop`` closes the connection
    instead of passing an answer or ``replace`` passes another."""

    def __init__(self, backend: int) -> None:
        self.backend = backend
        super().__init__("test-proxy")

    async def hold(self, head: bytes) -> None:
        """Awaited before the request goes on to core."""

    def drop(self, head: bytes, answer: bytes) -> bool:
        """Whether to close the agent's connection instead of passing core's answer."""
        return False

    def replace(self, head: bytes, answer: bytes) -> bytes | None:
        """A whole HTTP message to pass instead of core's answer (core heard the
        request); None passes core's."""
        return None

    async def answer(self, head: bytes, body: bytes) -> bytes | None:
        """An answer of the proxy's own (a whole HTTP message) instead of core's, the
        request never passed on; ``b""`` closes the agent's connection; None passes it."""
        return None

    async def _message(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        """One HTTP message: its head and its body."""
        head = await reader.readuntil(b"\r\n\r\n")
        assert len(head) < MAX_HEAD
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        return head, await reader.readexactly(length) if length else b""

    async def serve(self, agent_r: asyncio.StreamReader, agent_w: asyncio.StreamWriter) -> None:
        core_r, core_w = await asyncio.open_connection("127.0.0.1", self.backend)
        self.track(core_w)
        try:
            while True:
                head, body = await self._message(agent_r)
                own = await self.answer(head, body)
                if own == b"":
                    return
                if own is not None:
                    agent_w.write(own)
                    await agent_w.drain()
                    continue
                await self.hold(head)
                core_w.write(head + body)
                await core_w.drain()
                answer_head, answer = await self._message(core_r)
                if self.drop(head, answer):
                    return  # both connections closed below: the answer never arrives
                agent_w.write(self.replace(head, answer) or answer_head + answer)
                await agent_w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for writer in (agent_w, core_w):
                writer.close()
