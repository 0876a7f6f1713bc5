"""A lean HTTP/1.1 transport for httpx, the one Cairn's clients of its services use.

httpx's own transport (httpcore, h11, anyio) cost a worker agent's turn about seven times
the CPU of the same request on a bare keep-alive connection (docs/benchmarks.md, "The
turn's HTTP client"). This one keeps httpx's client, its ``Response`` and its exceptions,
so callers see no difference, and sends each request on an asyncio protocol of its own:

- a pool of keep-alive connections per (scheme, host, port), bounded as httpx's
  ``Limits`` say (connections in all, idle ones kept, idle expiry); a connection goes
  back to it only once its answer arrived whole and neither side said ``Connection:
  close``; one whose request was cancelled, or whose answer was left unread, is closed;
  ``aclose()`` fails the requests still waiting for one, and closes every socket at
  once, without awaiting TLS's closing exchange (the event loop may end next);
- a request's head and body in one write;
- answers parsed by ``httptools`` (Content-Length, chunked, or up to the close), streamed
  to the caller as they arrive, reading paused while the caller lags;
- timeouts from the request's ``timeout`` extension, and errors, as httpx raises them;
- an idle connection the server closed is seen before it is reused (the socket polled);
  a request goes again on a fresh connection only when nothing of it can have reached
  the server (its write failed at once), or, for a safe method, when a reused
  connection closed before the first byte of an answer.

Proxies and unix sockets stay httpx's own: ``ApiClient`` uses this transport only where
the environment names no proxy for its URL (``proxy_applies``)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import select
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httptools
import httpx

#: httpx's own default limits (``httpx.AsyncClient``'s), but an idle connection kept 4 s,
#: not 5: uvicorn closes one idle 5 s, and a POST sent as it does so cannot go again
DEFAULT_LIMITS = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=4.0
)
#: a head larger than this is refused, as httpcore refuses it (``MAX_INCOMPLETE_EVENT_SIZE``);
#: so are trailers, or a chunk's size line, as long: bytes that are no body, which httptools
#: would gather (a trailer's value) or chew through (a chunk extension) without end
MAX_HEAD = 100 * 1024
#: an answer's bytes held for a slow reader before reading from the socket pauses
HELD_MAX = 256 * 1024
#: methods that may go again after a reused connection closed without a byte of answer
SAFE = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DEFAULT_PORT = {b"http": 80, b"https": 443}

Key = tuple[bytes, bytes, int]


def proxy_applies(url: httpx.URL | str) -> bool:
    """Whether httpx, trusting the environment (``HTTP_PROXY``, ``HTTPS_PROXY``,
    ``ALL_PROXY``, ``NO_PROXY``), would send a request for ``url`` through a proxy."""
    from httpx._utils import URLPattern, get_environment_proxies  # httpx's own rule

    url = httpx.URL(url)
    proxies = get_environment_proxies().items()
    patterns = sorted(((URLPattern(k), v) for k, v in proxies), key=lambda kv: kv[0])
    return next((v is not None for p, v in patterns if p.matches(url)), False)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, its answer parsed as it arrives."""

    def __init__(self, pool: LeanTransport, key: Key) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.closed = False
        self.idle_since = 0.0
        self._fd = -1
        self._waiter: asyncio.Future[bool] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused = False
        self._begin(head_only=False)

    def _begin(self, *, head_only: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.head_only = head_only
        self.status = 0
        self.version = b"HTTP/1.1"
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_size = 0  # bytes since the last of the answer's progress (head, body, end)
        self.progress = False
        self.head_done = False
        self.framed = False  # Content-Length or chunked: the end is not the close
        self.complete = False
        self.received = False  # any byte of the answer
        self.chunks: deque[bytes] = deque()
        self.held = 0
        self.error: Exception | None = None
        self.keep = True  # the request did not say Connection: close
        self.keep_alive = False

    # asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pool._open.add(self)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            self._fail(httpx.RemoteProtocolError("Received data while no answer was due."))
            self.close()
            return
        self.received = True
        self.progress = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("Upgrade answers are not supported."))
        except httptools.HttpParserError as exc:
            if not self.complete:
                self._fail(httpx.RemoteProtocolError(f"Invalid answer: {exc}"))
            # bytes past a whole answer (more than its Content-Length): the answer
            # stands, as httpcore gives it, and the connection is not reused
            self.keep_alive = False
        if self.progress or self.complete:
            self.head_size = 0
        elif self.error is None:
            self.head_size += len(data)
            if self.head_size > MAX_HEAD:
                what = "trailers or a chunk's size line" if self.head_done else "head"
                self._fail(httpx.RemoteProtocolError(f"The answer's {what} is too large."))
        if self.error is not None:
            self.close()
        self._wake()

    def eof_received(self) -> bool:
        if self.busy and self.head_done and not self.framed and not self.complete:
            self.complete = True  # a body delimited by the close
        elif not self.received:
            self._fail(httpx.RemoteProtocolError("Server disconnected without sending a response."))
        elif not self.complete:
            self._fail(httpx.RemoteProtocolError("peer closed connection before the answer's end"))
        self.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._fail(httpx.ReadError(str(exc) or type(exc).__name__))
        elif not self.complete:
            self._fail(httpx.RemoteProtocolError("The connection closed before the answer's end."))
        self.pool._open.discard(self)
        self._forget()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._wake()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # httptools' side
    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # informational: the answer follows
            self.reason, self.headers = b"", []
            return
        if self.head_done:
            self._fail(httpx.RemoteProtocolError("More than one answer to one request."))
            return
        self.status, self.head_done, self.progress = status, True, True
        self.version = b"HTTP/" + self.parser.get_http_version().encode("ascii")
        self.keep_alive = self.keep and self.parser.should_keep_alive() and not self.head_only
        self.framed = status in (204, 304) or any(
            n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.headers
        )
        if self.head_only:
            self.framed = self.complete = True

    def on_body(self, body: bytes) -> None:
        self.progress = True
        if self.head_only:
            return
        self.chunks.append(body)
        self.held += len(body)
        if self.held > HELD_MAX and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True

    # the pool's side
    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def stale(self) -> bool:
        """Whether an idle connection cannot take a request: closed, or readable (the
        server closed it, or wrote out of turn), as httpcore asks before a reuse."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return True
        if self._fd < 0:
            return False
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        return bool(poll.poll(0))

    def send(self, data: bytes, request: httpx.Request) -> bool:
        """Write a request whole; False when the write failed at once (nothing sent)."""
        assert self.transport is not None
        self._begin(head_only=request.method == "HEAD")
        self.keep = request.headers.get("connection", "").lower() != "close"
        self.busy = True
        self.transport.write(data)
        return not self.transport.is_closing()

    async def drain(self, timeout: float | None) -> None:
        if self._writable is None or self._writable.done():
            return
        if not await _within(self._writable, timeout):
            raise httpx.WriteTimeout("Timed out while sending the request.")

    async def wait(self, timeout: float | None) -> None:
        """Until the answer moves on (a head, a piece of body, its end or an error)."""
        if self.error is not None:
            raise self.error
        fut = self._waiter = asyncio.get_running_loop().create_future()
        try:
            if not await _within(fut, timeout):
                raise httpx.ReadTimeout("Timed out while receiving the answer.")
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.held = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def done(self) -> None:
        """The caller is done with the answer: idle again when it arrived whole and the
        connection is kept alive, closed otherwise."""
        if self.closed:
            return
        if self.complete and self.error is None and self.keep_alive:
            self.busy = False
            self.take()  # a whole answer left unread: reading resumes, or the next stalls
            self.pool._idle(self)
        else:
            self.close()

    def close(self, *, at_once: bool = False) -> None:
        """Close the connection: ``at_once``, or with bytes unsent (of no use now), its
        socket in asyncio's next pass, without the rest of its writes or TLS's closing
        exchange (a close_notify, then waiting for the server's)."""
        if self.transport is not None:
            if at_once or self.transport.get_write_buffer_size():
                self.transport.abort()
            else:
                self.transport.close()
        self._forget()

    def _forget(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._closed(self)


async def _within(fut: asyncio.Future[Any], timeout: float | None) -> bool:
    """Whether ``fut`` completes within ``timeout`` seconds (None: no bound)."""
    if timeout is None:
        await fut
        return True
    timer = asyncio.get_running_loop().call_later(timeout, _expire, fut)
    try:
        await fut
    finally:
        timer.cancel()
    return fut.result() is not False


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(False)


class _Streamed(httpx.AsyncByteStream):
    """An answer's body as it arrives; the connection is given back at its close."""

    def __init__(self, conn: _Connection, timeout: float | None) -> None:
        self._conn, self._timeout = conn, timeout
        self._given_back = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    yield conn.take()
                elif conn.complete:
                    return
                else:
                    await conn.wait(self._timeout)
        except BaseException:
            # An iteration left part-way is closed by asyncio's finalizer, later than the
            # answer's close: by then its connection, given back, may carry the next request.
            if not self._given_back:
                conn.close()
            raise

    async def aclose(self) -> None:
        self._given_back = True
        self._conn.done()


class LeanTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` over HTTP/1.1 keep-alive connections of its own
    (the module's docstring). ``verify``, ``cert``, ``trust_env`` and ``limits`` mean
    what they mean to ``httpx.AsyncHTTPTransport``."""

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | str | bool = True,
        cert: Any = None,
        trust_env: bool = True,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ) -> None:
        self._tls = (verify, cert, trust_env)
        self._ssl: ssl.SSLContext | None = None
        self._max = limits.max_connections
        self._max_idle = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._all: set[_Connection] = set()
        #: every connection whose socket may be open: those of ``_all`` connected, and
        #: those closed whose close is under way (TLS's, until the server's close_notify)
        self._open: set[_Connection] = set()
        self._idle_by: dict[Key, list[_Connection]] = {}
        self._idle_count = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closings = 0  # aclose() calls: a request that waited across one fails

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        try:
            body = request.content
        except httpx.RequestNotRead:
            return await self._streamed(request, timeout)
        data = _head(request) + body
        conn, reused = await self._acquire(request, timeout)
        try:
            if not conn.send(data, request) and reused:
                # the write failed at once: nothing of it reached the server
                conn.close()
                conn, reused = await self._acquire(request, timeout, fresh=True)
                conn.send(data, request)
            return await self._answer(conn, timeout)
        except BaseException as exc:
            conn.close()
            lost = isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError)
            if not (lost and reused and not conn.received and request.method in SAFE):
                raise
        # A safe request on a reused connection that closed before any byte of an answer
        # (the server's idle close crossing it): once more, on a fresh connection.
        conn, _ = await self._acquire(request, timeout, fresh=True)
        try:
            conn.send(data, request)
            return await self._answer(conn, timeout)
        except BaseException:
            conn.close()
            raise

    async def _streamed(self, request: httpx.Request, timeout: dict[str, Any]) -> httpx.Response:
        """A request whose body is a stream: its head, then its pieces as they come."""
        chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
        conn, _ = await self._acquire(request, timeout)
        try:
            conn.send(_head(request), request)
            async for piece in request.stream:  # type: ignore[union-attr]
                if piece and conn.transport is not None and not conn.closed:
                    conn.transport.write(
                        b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
                    )
                    await conn.drain(timeout.get("write"))
            if chunked and conn.transport is not None and not conn.closed:
                conn.transport.write(b"0\r\n\r\n")
            return await self._answer(conn, timeout)
        except BaseException:
            conn.close()
            raise

    async def _answer(self, conn: _Connection, timeout: dict[str, Any]) -> httpx.Response:
        await conn.drain(timeout.get("write"))
        read = timeout.get("read")
        while not conn.head_done:
            await conn.wait(read)
        extensions = {"http_version": conn.version, "reason_phrase": conn.reason}
        if conn.complete:  # the whole answer is here: the connection is free already
            body = conn.take()
            headers = conn.headers
            conn.done()
            return httpx.Response(
                conn.status, headers=headers, stream=httpx.ByteStream(body), extensions=extensions
            )
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Streamed(conn, read),
            extensions=extensions,
        )

    async def _acquire(
        self, request: httpx.Request, timeout: dict[str, Any], *, fresh: bool = False
    ) -> tuple[_Connection, bool]:
        """A connection to the request's origin and whether it was idle in the pool."""
        url = request.url
        scheme = url.raw_scheme
        if scheme not in _DEFAULT_PORT:
            raise httpx.UnsupportedProtocol(f"Request URL has an unsupported protocol '{url}'.")
        key = (scheme, url.raw_host, url.port or _DEFAULT_PORT[scheme])
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._forget_all()  # a new event loop: the old one's connections are gone
            self._loop = loop
        deadline = None if timeout.get("pool") is None else loop.time() + timeout["pool"]
        closings = self._closings
        while True:
            self._expire_idle()
            if not fresh and (conn := self._reuse(key)) is not None:
                return conn, True
            if self._max is None or len(self._all) < self._max:
                conn = await self._connect(request, key, timeout.get("connect"))
                if self._closings != closings:  # closed while it connected: not pooled
                    conn.close()
                    raise httpx.ConnectError("The client was closed.")
                return conn, False
            if self._idle_count:
                self._oldest_idle().close()  # room for this origin
                continue
            await self._wait_for_room(deadline)
            if self._closings != closings:
                raise httpx.ConnectError("The client was closed.")

    def _reuse(self, key: Key) -> _Connection | None:
        idle = self._idle_by.get(key)
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            if not conn.stale():
                conn.busy = True
                return conn
            conn.close()
        return None

    async def _connect(
        self, request: httpx.Request, key: Key, timeout: float | None
    ) -> _Connection:
        scheme, host, port = key
        ssl_context = server_hostname = None
        if scheme == b"https":
            ssl_context = self._ssl_context()
            sni = request.extensions.get("sni_hostname")
            server_hostname = sni.decode() if isinstance(sni, bytes) else sni or host.decode()
        conn = _Connection(self, key)
        conn.busy = True
        self._all.add(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(
                    lambda: conn,
                    host.decode(),
                    port,
                    ssl=ssl_context,
                    server_hostname=server_hostname,
                )
        except TimeoutError as exc:
            conn.close()
            raise httpx.ConnectTimeout("Timed out while connecting.") from exc
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            verify, cert, trust_env = self._tls
            self._ssl = httpx.create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)
        return self._ssl

    async def _wait_for_room(self, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiting.append(fut)
        try:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            if not await _within(fut, left):
                raise httpx.PoolTimeout("Timed out while waiting for a connection.")
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.result() is None:
                self._wake_one()  # a wake-up it got goes on to the next in line
            raise
        finally:
            if fut in self._waiting:
                self._waiting.remove(fut)

    def _wake_one(self) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _idle(self, conn: _Connection) -> None:
        if self._max_idle is not None and self._idle_count >= self._max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle_by.setdefault(conn.key, []).append(conn)
        self._idle_count += 1
        self._wake_one()

    def _closed(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if not conn.busy:
            idle = self._idle_by.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
                self._idle_count -= 1
        self._wake_one()

    def _expire_idle(self) -> None:
        if not self._idle_count or self._expiry is None:
            return
        cutoff = time.monotonic() - self._expiry
        for idle in self._idle_by.values():
            while idle and idle[0].idle_since < cutoff:
                idle[0].close()

    def _oldest_idle(self) -> _Connection:
        return min((c for idle in self._idle_by.values() for c in idle), key=lambda c: c.idle_since)

    def _forget_all(self) -> None:
        for conn in self._all | self._open:
            if conn.transport is not None:
                with contextlib.suppress(RuntimeError):  # its event loop is closed
                    conn.transport.close()
        self._all.clear()
        self._open.clear()
        self._idle_by.clear()
        self._idle_count = 0
        self._waiting.clear()

    async def aclose(self) -> None:
        self._closings += 1
        # At once, those closing already too: a TLS connection's close waits for the
        # server's close_notify (up to 30 s), and the caller's event loop may end next
        # (``asyncio.run``), leaving the socket open until the garbage collector finds it.
        for conn in list(self._all | self._open):
            conn.close(at_once=True)
        while self._waiting:  # those waiting for a connection fail, not connect anew
            self._wake_one()
        self._forget_all()
        await asyncio.sleep(0)  # their sockets closed (asyncio's next pass)


def _head(request: httpx.Request) -> bytes:
    """The request line and headers, refused (as h11 refuses them) if a name is no token
    or a value would break the head (CR, LF, NUL)."""
    method = request.method.encode("ascii")
    raw = request.headers.raw
    if not _TOKEN.fullmatch(method) or not all(_TOKEN.fullmatch(n) for n, _ in raw):
        raise httpx.LocalProtocolError("Illegal method or header name.")
    lines = [b"%s %s HTTP/1.1" % (method, request.url.raw_path)]
    lines += [b"%s: %s" % pair for pair in raw]
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    if head.count(b"\n") != len(lines) + 1 or head.count(b"\r") != len(lines) + 1 or b"\0" in head:
        raise httpx.LocalProtocolError("Illegal header value.")
    return head
