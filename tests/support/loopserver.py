"""A TCP server on 127.0.0.1 for tests that stand between a client and a server (proxies,
balancers): an asyncio loop of its own in a thread, started ready and stopped with all it
holds closed."""

from __future__ import annotations

import asyncio
import threading

from tests.support import free_port


class LoopServer:
    """Serves each connection with :meth:`serve` on a free port of 127.0.0.1 from a loop in
    a thread; :meth:`stop` ends it. Every connection's writer, and those :meth:`serve`
    passes to :meth:`track`, is closed when it stops, as are the tasks still serving."""

    def __init__(self, name: str) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.writers: set[asyncio.StreamWriter] = set()  # every connection, both sides
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()
        assert self.ready.wait(10), f"{name} did not start"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One accepted connection, to its end."""
        raise NotImplementedError

    def track(self, writer: asyncio.StreamWriter) -> None:
        """A connection :meth:`serve` opened, closed with the rest when the server stops."""
        self.writers.add(writer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.track(writer)
        try:
            await self.serve(reader, writer)
        except asyncio.CancelledError:
            # Stopped while serving: the handler ends. Python 3.11's start_server asks a
            # handler's task for its exception when it is done, which raises for a
            # cancelled one and logged "Exception in callback" in whichever test ran then.
            return

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", self.port)
        )
        self.ready.set()
        try:
            self.loop.run_forever()
        finally:
            # Close what it holds (the connections, the listener, the loop itself): left
            # to the garbage collector they warn in whichever test runs then.
            server.close()
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            for writer in self.writers:
                writer.transport.abort()  # also one cancelled before it was served
            self.loop.run_until_complete(asyncio.sleep(0.05))  # transports finish closing
            self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
