"""Cairn's HTTP/1.1 transport (``libs/common/transport.py``) against small real servers on
loopback, each connection served by a thread of its own: keep-alive and when a connection
is not reused, bodies of each framing, streaming, cancellation, timeouts and errors as
httpx raises them, TLS, the pool's bound, and where httpx's own transport stays."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from libs.common.client import CoreClient
from libs.common.transport import HELD_MAX, LeanTransport
from tests.support.tls import loopback_cert

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
WAIT_S = 5.0


class Conn:
    """One accepted connection, read as HTTP/1.1 requests."""

    def __init__(self, sock: socket.socket, number: int) -> None:
        self.sock, self.number = sock, number
        self.file = sock.makefile("rb")

    def request(self) -> bytes | None:
        """The next request's head and body (Content-Length or chunked); None at EOF."""
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.file.readline()
            if not line:
                return None
            head += line
        lowered = head.lower()
        if b"transfer-encoding: chunked" in lowered:
            body = b""
            while size := int(self.file.readline().strip(), 16):
                body += self.file.read(size + 2)[:-2]
            self.file.readline()
            return head + body
        length = 0
        for line in lowered.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return head + self.file.read(length)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self) -> bool:
        """Whether the client closed its end (EOF) within a few seconds."""
        self.sock.settimeout(WAIT_S)
        try:
            return self.file.read() == b""
        except TimeoutError:
            return False
        except OSError:  # reset: closed too
            return True


class Server:
    """A loopback server calling ``serve(conn)`` in a thread per accepted connection."""

    def __init__(self, serve: Callable[[Conn], None], tls: ssl.SSLContext | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.errors: list[BaseException] = []
        self._serve, self._tls = serve, tls
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                number = self.connections
            threading.Thread(target=self._run, args=(sock, number), daemon=True).start()

    def _run(self, sock: socket.socket, number: int) -> None:
        with self._lock:
            self.open += 1
            self.most_open = max(self.most_open, self.open)
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            self._serve(Conn(sock, number))
        except (OSError, ValueError) as exc:
            self.errors.append(exc)
        finally:
            with self._lock:
                self.open -= 1
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(handler: Callable[[Conn], None], tls: ssl.SSLContext | None = None) -> Server:
        servers.append(Server(handler, tls))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def keep_alive(conn: Conn) -> None:
    """Answer every request on the connection with OK."""
    while conn.request() is not None:
        conn.send(OK)


def client(server: Server, **kwargs: Any) -> httpx.AsyncClient:
    timeout = kwargs.pop("timeout", httpx.Timeout(WAIT_S))
    return httpx.AsyncClient(
        base_url=server.url, transport=LeanTransport(**kwargs), timeout=timeout
    )


def get(server: Server, path: str = "/", **kwargs: Any) -> httpx.Response:
    """One GET of ``path`` by a new client of ``server`` (``kwargs``: the client's), in
    an event loop of its own; what it raises, raised."""

    async def call() -> httpx.Response:
        async with client(server, **kwargs) as http:
            return await http.get(path)

    return asyncio.run(call())


def test_the_default_client_keeps_one_connection_alive_for_many_requests(serve: Any) -> None:
    server = serve(keep_alive)

    async def calls() -> list[str]:
        async with CoreClient(server.url, "t") as core:
            assert isinstance(core._http._transport, LeanTransport)
            return [(await core._call("POST", "/x", content="{}")).text for _ in range(20)]

    assert asyncio.run(calls()) == ["ok"] * 20
    assert server.connections == 1


def test_an_idle_connection_past_its_expiry_is_not_reused(serve: Any) -> None:
    server = serve(keep_alive)

    async def calls() -> None:
        async with client(server, limits=httpx.Limits(keepalive_expiry=0.1)) as http:
            await http.get("/")
            await http.get("/")  # within the expiry: the same connection
            await asyncio.sleep(0.3)
            await http.get("/")

    asyncio.run(calls())
    assert server.connections == 2


def test_an_idle_connection_the_server_closed_is_not_reused(serve: Any) -> None:
    """The server answers one request per connection (keep-alive announced) and closes it
    while the client's loop is busy elsewhere (it cannot have read the close): the client
    sees the close on the socket before reuse and sends its POST on a fresh connection."""
    closed = threading.Event()

    def once(conn: Conn) -> None:
        conn.request()
        conn.send(OK)
        conn.sock.shutdown(socket.SHUT_RDWR)
        closed.set()

    server = serve(once)

    async def calls() -> list[str]:
        async with client(server) as http:
            texts = []
            for _ in range(3):
                closed.clear()
                texts.append((await http.post("/", content=b"{}")).text)
                assert closed.wait(WAIT_S)  # blocking: the loop does not run meanwhile
                time.sleep(0.05)  # the close reaches the client's socket
            return texts

    assert asyncio.run(calls()) == ["ok"] * 3
    assert server.connections == 3


def test_connection_close_from_the_server_is_honoured(serve: Any) -> None:
    requests_on: dict[int, int] = {}

    def closing(conn: Conn) -> None:
        conn.sock.settimeout(1.0)
        try:
            while conn.request() is not None:
                requests_on[conn.number] = requests_on.get(conn.number, 0) + 1
                conn.send(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
        except TimeoutError:
            pass  # left open: only the header says close

    server = serve(closing)

    async def calls() -> None:
        async with client(server) as http:
            for _ in range(3):
                assert (await http.get("/")).text == "ok"

    asyncio.run(calls())
    assert requests_on == {1: 1, 2: 1, 3: 1}


def test_chunked_and_close_delimited_bodies_arrive_whole(serve: Any) -> None:
    def bodies(conn: Conn) -> None:
        while (request := conn.request()) is not None:
            if request.startswith(b"GET /chunked"):
                conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
                time.sleep(0.05)
                conn.send(b"6\r\n world\r\n0\r\n\r\n")
            else:
                conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil ")
                time.sleep(0.05)
                conn.send(b"the close")
                return

    server = serve(bodies)

    async def calls() -> list[str]:
        async with client(server) as http:
            return [
                (await http.get("/chunked")).text,
                (await http.get("/close")).text,
                (await http.get("/chunked")).text,
            ]

    assert asyncio.run(calls()) == ["hello world", "until the close", "hello world"]
    assert server.connections == 2  # the close-delimited answer ended its connection


def test_a_stream_closed_early_closes_its_connection(serve: Any) -> None:
    """A streamed answer left before its end: its connection is closed, not reused."""
    saw_close = threading.Event()

    def streaming(conn: Conn) -> None:
        if conn.number == 1:
            conn.request()
            conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            conn.send(b"6\r\nline1\n\r\n6\r\nline2\n\r\n")
            if conn.closed_by_peer():
                saw_close.set()
        else:
            keep_alive(conn)

    server = serve(streaming)

    async def calls() -> tuple[list[str], str]:
        async with client(server) as http:
            lines = []
            async with http.stream("GET", "/follow") as answer:
                async for line in answer.aiter_lines():
                    lines.append(line)
                    if len(lines) == 2:
                        break
            return lines, (await http.get("/")).text

    assert asyncio.run(calls()) == (["line1", "line2"], "ok")
    assert server.connections == 2
    assert saw_close.wait(WAIT_S)


def test_follow_log_streams_pieces_and_leaves_at_the_end(serve: Any) -> None:
    """``CoreClient.follow_log`` (server-sent events, chunked) on the default transport:
    the pieces as they come, the end, and the stream left open by core is closed."""
    saw_close = threading.Event()
    piece = b'{"attempt_id": 1, "offset": 0, "next_offset": 3, "text": "hi\\n"}'
    end = b'{"attempt_id": 1, "outcome": "succeeded", "next_offset": 3, "task_state": "succeeded"}'

    def sse(conn: Conn) -> None:
        conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        conn.send(b"transfer-encoding: chunked\r\n\r\n")
        for event in (
            b"event: log\ndata: " + piece + b"\n\n",
            b"event: end\ndata: " + end + b"\n\n",
        ):
            conn.send(b"%x\r\n%s\r\n" % (len(event), event))
            time.sleep(0.02)
        if conn.closed_by_peer():
            saw_close.set()

    server = serve(sse)

    async def follow() -> list[Any]:
        async with CoreClient(server.url, "t") as core:
            return [item async for item in core.follow_log(7)]

    items = asyncio.run(follow())
    assert [type(item).__name__ for item in items] == ["LogPiece", "LogEnd"]
    assert items[0].text == "hi\n"  # type: ignore[union-attr]
    assert saw_close.wait(WAIT_S)


def test_a_follow_left_at_its_end_leaves_the_next_request_its_connection(serve: Any) -> None:
    """``follow_log``'s shape: lines read from a stream inside a generator that returns at
    the end event. The stream's iteration is closed by asyncio's finalizer after the
    answer was given back, and must not close the connection the next POST now uses."""

    def follow_then_answer(conn: Conn) -> None:
        conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        time.sleep(0.1)  # the body after the head: the answer is streamed
        body = b"event: log\ndata: 1\n\nevent: end\ndata: 2\n\n"
        conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        while conn.request() is not None:
            time.sleep(0.2)  # the finalizer runs while the POST waits
            conn.send(OK)

    server = serve(follow_then_answer)

    async def calls() -> tuple[list[str], str]:
        async with client(server) as http:

            async def follow() -> AsyncIterator[str]:
                async with http.stream("GET", "/follow") as answer:
                    async for line in answer.aiter_lines():
                        yield line
                        if line == "data: 2":
                            return

            lines = [line async for line in follow()]
            return lines, (await http.post("/", content=b"{}")).text

    lines, text = asyncio.run(calls())
    assert lines[-1] == "data: 2" and text == "ok"
    assert server.connections == 1


def test_a_whole_answer_left_unread_gives_back_a_connection_that_reads(serve: Any) -> None:
    """An answer past the held bound pauses reading; left unread once whole, its
    connection goes back to the pool reading again, or the next answer never arrives.
    (Its last byte is the one past the bound: reading pauses as it ends.)"""
    size = HELD_MAX + 1

    def large_then_ok(conn: Conn) -> None:
        if conn.number == 1:
            conn.request()
            conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
            time.sleep(0.1)  # the body after the head: the answer is streamed
            conn.send(b"x" * size)
        keep_alive(conn)

    server = serve(large_then_ok)

    async def calls() -> str:
        async with client(server, timeout=httpx.Timeout(2.0)) as http:
            async with http.stream("GET", "/large"):
                (conn,) = http._transport._all  # type: ignore[attr-defined]
                for _ in range(100):
                    if conn.complete:
                        break
                    await asyncio.sleep(0.05)
                assert conn._paused
            return (await http.get("/")).text

    assert asyncio.run(calls()) == "ok"
    assert server.connections == 1


def test_requests_waiting_for_a_connection_fail_when_the_client_closes(serve: Any) -> None:
    """Closed with one request in flight and one waiting for the only connection: both
    fail, and the waiting one does not open a connection of its own afterwards."""
    asked, release = threading.Event(), threading.Event()

    def unanswered(conn: Conn) -> None:
        conn.request()
        asked.set()
        release.wait(WAIT_S)

    server = serve(unanswered)

    async def calls() -> list[str]:
        http = client(server, limits=httpx.Limits(max_connections=1), timeout=None)
        requests = [asyncio.create_task(http.get("/")) for _ in range(2)]
        await asyncio.to_thread(asked.wait, WAIT_S)  # one sent, the other waiting
        await http.aclose()
        done, pending = await asyncio.wait(requests, timeout=WAIT_S)
        for task in pending:
            task.cancel()
        assert not http._transport._all  # type: ignore[attr-defined]
        return sorted(type(task.exception()).__name__ for task in done)

    try:
        assert asyncio.run(calls()) == ["ConnectError", "RemoteProtocolError"]
    finally:
        release.set()
    assert server.connections == 1


def test_bytes_past_the_content_length_leave_the_answer_and_drop_the_connection(
    serve: Any,
) -> None:
    """A server that sends more than its Content-Length: the answer is what the length
    says (as httpcore gives it), and the connection is not reused."""

    def too_long(conn: Conn) -> None:
        conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokSMUGGLED")
        keep_alive(conn)

    server = serve(too_long)

    async def calls() -> list[str]:
        async with client(server) as http:
            return [(await http.get("/")).text, (await http.get("/")).text]

    assert asyncio.run(calls()) == ["ok", "ok"]
    assert server.connections == 2


def test_the_http_version_and_repeated_headers_are_the_servers(serve: Any) -> None:
    def http10(conn: Conn) -> None:
        conn.request()
        conn.send(
            b"HTTP/1.0 200 OK\r\nset-cookie: a=1\r\nset-cookie: b=2\r\ncontent-length: 2\r\n\r\nok"
        )

    server = serve(http10)

    answer = get(server)
    assert answer.http_version == "HTTP/1.0"
    assert answer.headers.get_list("set-cookie") == ["a=1", "b=2"]
    assert answer.request.url == httpx.URL(server.url + "/")


def test_a_cancelled_request_discards_its_connection(serve: Any) -> None:
    """The first request is never answered and is cancelled: its connection is closed at
    once (the second connection answers only once the first is closed)."""
    first_closed = threading.Event()

    def slow_first(conn: Conn) -> None:
        if conn.number == 1:
            conn.request()
            if conn.closed_by_peer():
                first_closed.set()
        else:
            conn.request()
            conn.send(OK if first_closed.wait(WAIT_S) else b"HTTP/1.1 409 Conflict\r\n\r\n")

    server = serve(slow_first)

    async def calls() -> str:
        async with client(server) as http:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(http.post("/", content=b"{}"), 0.2)
            return (await http.get("/")).text

    assert asyncio.run(calls()) == "ok"
    assert server.connections == 2


def test_a_head_past_its_bound_is_refused(serve: Any) -> None:
    def large(conn: Conn) -> None:
        conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 150_000)
        time.sleep(0.05)  # the head is still incomplete past the bound
        conn.send(b"\r\n\r\n")
        conn.closed_by_peer()

    server = serve(large)

    with pytest.raises(httpx.RemoteProtocolError, match="too large"):
        get(server)


@pytest.mark.parametrize(
    "after_body",
    [b"0\r\nx-trailer: ", b"2;ext="],  # a trailer's value; a chunk's size line
    ids=["trailer", "chunk-extension"],
)
def test_bytes_after_the_head_that_are_no_body_are_bounded_too(
    serve: Any, after_body: bytes
) -> None:
    """A hostile server that sends, after a body's first chunk, a trailer or a chunk
    extension without end: refused past the head's bound, not gathered."""

    def endless(conn: Conn) -> None:
        conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n")
        conn.send(after_body)
        for _ in range(40):
            conn.send(b"a" * 50_000)
            time.sleep(0.005)
        conn.closed_by_peer()

    server = serve(endless)

    with pytest.raises(httpx.RemoteProtocolError, match="too large"):
        get(server)


def test_a_safe_request_goes_again_when_a_reused_connection_closes_unanswered(
    serve: Any,
) -> None:
    """The server reads the second request on a kept connection and closes it without a
    byte of answer: a GET goes again on a fresh connection; a POST is not sent twice."""

    def drop_second(conn: Conn) -> None:
        conn.request()
        conn.send(OK)
        if conn.number % 2 == 1:
            conn.request()  # read, then closed unanswered
        else:
            keep_alive(conn)

    server = serve(drop_second)

    async def calls(method: str) -> str:
        async with client(server) as http:
            await http.request(method, "/")
            return (await http.request(method, "/")).text

    assert asyncio.run(calls("GET")) == "ok"
    assert server.connections == 2
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        asyncio.run(calls("POST"))
    assert server.connections == 3


def test_a_read_timeout_is_httpxs(serve: Any) -> None:
    server = serve(lambda conn: (conn.request(), conn.closed_by_peer()))

    with pytest.raises(httpx.ReadTimeout):
        get(server, timeout=httpx.Timeout(WAIT_S, read=0.2))


def test_a_write_timeout_is_httpxs(serve: Any) -> None:
    """The server never reads: a large body fills the socket's buffers."""
    done = threading.Event()
    server = serve(lambda conn: done.wait(WAIT_S))

    async def call() -> None:
        async with client(server, timeout=httpx.Timeout(WAIT_S, write=0.2)) as http:
            await http.post("/", content=b"x" * (64 << 20))

    with pytest.raises(httpx.WriteTimeout):
        asyncio.run(call())
    done.set()


def test_a_connect_timeout_is_httpxs() -> None:
    """A listener whose backlog is full: the kernel drops the connection's SYN."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    filled = [socket.socket() for _ in range(2)]
    for sock in filled:
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))

    async def call() -> None:
        timeout = httpx.Timeout(WAIT_S, connect=0.3)
        async with httpx.AsyncClient(transport=LeanTransport(), timeout=timeout) as http:
            await http.get(f"http://127.0.0.1:{port}/")

    try:
        with pytest.raises(httpx.ConnectTimeout):
            asyncio.run(call())
    finally:
        for sock in [*filled, listener]:
            sock.close()


def test_a_pool_timeout_is_httpxs_and_the_pool_is_bounded(serve: Any) -> None:
    def slow(conn: Conn) -> None:
        while (request := conn.request()) is not None:
            time.sleep(0.05)
            if request.startswith(b"GET /hold"):  # an answer that does not end
                conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\n.\r\n")
                conn.closed_by_peer()
                return
            conn.send(OK)

    server = serve(slow)

    async def calls() -> list[str]:
        limits = httpx.Limits(max_connections=2)
        async with client(server, limits=limits) as http:
            answers = await asyncio.gather(*(http.get("/") for _ in range(8)))
            async with http.stream("GET", "/hold"), http.stream("GET", "/hold"):
                with pytest.raises(httpx.PoolTimeout):
                    await http.get("/", timeout=httpx.Timeout(WAIT_S, pool=0.1))
            return [answer.text for answer in answers]

    assert asyncio.run(calls()) == ["ok"] * 8
    assert server.most_open == 2


def test_a_refused_connection_is_a_connect_error() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()

    async def call() -> None:
        async with httpx.AsyncClient(transport=LeanTransport()) as http:
            await http.get(f"http://127.0.0.1:{port}/")

    with pytest.raises(httpx.ConnectError):
        asyncio.run(call())


def test_garbage_and_an_early_close_are_remote_protocol_errors(serve: Any) -> None:
    def bad(conn: Conn) -> None:
        request = conn.request() or b""
        if request.startswith(b"GET /garbage"):
            conn.send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            conn.closed_by_peer()
        else:  # a body cut short
            conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")

    server = serve(bad)

    with pytest.raises(httpx.RemoteProtocolError):
        get(server, "/garbage")
    with pytest.raises(httpx.RemoteProtocolError):
        get(server, "/short")


def test_a_header_that_would_break_the_head_is_refused(serve: Any) -> None:
    server = serve(keep_alive)

    async def call() -> None:
        async with client(server) as http:
            await http.get("/", headers={"x-a": "b\r\nx-smuggled: 1"})

    with pytest.raises(httpx.LocalProtocolError):
        asyncio.run(call())
    assert server.connections == 0


def test_a_streamed_request_body_is_sent_chunked(serve: Any) -> None:
    got: list[bytes] = []

    def echo(conn: Conn) -> None:
        got.append(conn.request() or b"")
        conn.send(OK)

    server = serve(echo)

    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b"one ", b"two ", b"three"):
            yield piece

    async def call() -> str:
        async with client(server) as http:
            return (await http.post("/", content=pieces())).text

    assert asyncio.run(call()) == "ok"
    assert got[0].endswith(b"\r\n\r\none two three")


def test_https_verifies_the_servers_certificate(serve: Any, tmp_path: Path) -> None:
    cert_file, key_file = loopback_cert(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server = serve(keep_alive, tls=context)

    async def call(verify: ssl.SSLContext | bool) -> list[str]:
        async with client(server, verify=verify) as http:
            return [(await http.get("/")).text for _ in range(3)]

    trusted = ssl.create_default_context(cafile=str(cert_file))
    assert asyncio.run(call(trusted)) == ["ok"] * 3
    assert server.connections == 1
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(call(True))  # certifi's authorities do not know it


@pytest.mark.parametrize("answer", [OK, OK.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")])
def test_closing_the_client_closes_its_tls_sockets_before_its_loop_ends(
    serve: Any, tmp_path: Path, answer: bytes
) -> None:
    """A TLS connection's close sends a close_notify and waits for the server's; a client's
    ``aclose`` does not wait: the event loop that ends after it (``asyncio.run``) would
    leave the socket open until the garbage collector found it. The server here answers,
    then reads nothing more (no close_notify back): both the connection idle in the pool
    and one whose close (the server said ``connection: close``) is under way are closed."""
    cert_file, key_file = loopback_cert(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    release = threading.Event()

    def answer_then_hold(conn: Conn) -> None:
        conn.request()
        conn.send(answer)
        release.wait(WAIT_S)

    server = serve(answer_then_hold, tls=context)

    made: list[Any] = []

    class Recording(LeanTransport):
        async def _connect(self, *args: Any, **kwargs: Any) -> Any:
            made.append(await super()._connect(*args, **kwargs))
            return made[-1]

    async def call() -> tuple[str, int]:
        trusted = ssl.create_default_context(cafile=str(cert_file))
        http = httpx.AsyncClient(base_url=server.url, transport=Recording(verify=trusted))
        text = (await http.get("/")).text
        (conn,) = made  # idle in the pool, or closing
        sock = conn.transport.get_extra_info("socket")
        await http.aclose()
        return text, sock.fileno()

    try:
        assert asyncio.run(call()) == ("ok", -1)
    finally:
        release.set()


def test_a_proxy_from_the_environment_keeps_httpxs_transport(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a proxy the environment names, httpx's own transport (which speaks to
    proxies); where ``NO_PROXY`` exempts core, the lean one."""
    lines: list[bytes] = []

    def proxy(conn: Conn) -> None:
        while (request := conn.request()) is not None:
            lines.append(request.split(b"\r\n", 1)[0])
            conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nproxy")

    via = serve(proxy)
    target = "http://core.invalid:8080"
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", via.url)

    async def call() -> tuple[bool, str]:
        async with CoreClient(target, None) as core:
            lean = isinstance(core._http._transport, LeanTransport)
            if not lean:
                return lean, (await core._call("GET", "/v1/queues")).text
            return lean, ""

    assert asyncio.run(call()) == (False, "proxy")
    assert lines == [b"GET http://core.invalid:8080/v1/queues HTTP/1.1"]
    monkeypatch.setenv("NO_PROXY", "core.invalid")
    assert asyncio.run(call()) == (True, "")
