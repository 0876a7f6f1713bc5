"""The artifact cache (``services.worker.artifacts``): content-addressed, verified
before it is visible, over file://, http(s):// (a real server on 127.0.0.1 and
``httpx.MockTransport``) and s3:// (a moto server on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from services.worker import artifacts
from services.worker.artifacts import ArtifactCache, ArtifactError
from services.worker.executor import AttemptSpec, run_attempt
from tests.fixtures.s3 import moto_server

T = TypeVar("T")
TOOL = b"#!/bin/sh\necho fetched and run\n"
TOOL_SHA = hashlib.sha256(TOOL).hexdigest()
WRONG_SHA = hashlib.sha256(b"something else").hexdigest()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _source(tmp_path: Path, body: bytes = TOOL) -> tuple[Path, str]:
    path = tmp_path / "src" / "tool.sh"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(body)
    return path, path.as_uri()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


class _Server:
    """A plain HTTP server on 127.0.0.1 that serves ``routes``, counts the GETs and the
    connections (``connections`` made, ``open`` now) and keeps each GET's headers
    (``seen``). HTTP/1.0 (a connection per GET) unless ``keep_alive``: a test that lets
    it keep connections closes its cache before its event loop ends."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, bytes]] = {}
        self.redirects: dict[str, str] = {}  # path -> Location of a 302
        self.cookies: dict[str, str] = {}  # path -> a Set-Cookie its answer sends
        self.hits: dict[str, int] = {}
        self.seen: dict[str, dict[str, str]] = {}
        self.connections = self.open = 0
        self.keep_alive = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                super().setup()
                self.protocol_version = "HTTP/1.1" if server.keep_alive else "HTTP/1.0"
                server.connections += 1
                server.open += 1

            def finish(self) -> None:
                super().finish()
                server.open -= 1

            def do_GET(self) -> None:
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                server.seen[self.path] = {k.lower(): v for k, v in self.headers.items()}
                status, body = server.routes.get(self.path, (404, b"not found"))
                if self.path in server.redirects:
                    status, body = 302, b""
                    self.send_response(status)
                    self.send_header("Location", server.redirects[self.path])
                else:
                    self.send_response(status)
                if self.path in server.cookies:
                    self.send_header("Set-Cookie", server.cookies[self.path])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    thread.join()


def test_file_artifact_is_stored_by_digest_and_executable(tmp_path: Path) -> None:
    _, uri = _source(tmp_path)
    cache = ArtifactCache(tmp_path / "cache")

    path = _run(cache.fetch(uri, TOOL_SHA.upper()))

    assert path == tmp_path / "cache" / TOOL_SHA[:2] / TOOL_SHA
    assert path.read_bytes() == TOOL
    assert path.stat().st_mode & 0o777 == 0o755
    assert _files(tmp_path / "cache") == [path]


def test_digest_mismatch_is_not_retryable_and_leaves_nothing_runnable(tmp_path: Path) -> None:
    _, uri = _source(tmp_path)
    cache = ArtifactCache(tmp_path / "cache")

    with pytest.raises(ArtifactError) as caught:
        _run(cache.fetch(uri, WRONG_SHA))

    assert caught.value.retryable is False
    assert str(caught.value).startswith("sha256 mismatch")
    assert TOOL_SHA not in str(caught.value) and WRONG_SHA not in str(caught.value)
    assert _files(tmp_path / "cache") == []


def test_only_a_verified_artifact_is_run(tmp_path: Path) -> None:
    _, uri = _source(tmp_path)
    cache = ArtifactCache(tmp_path / "cache")

    async def fetch_then_run() -> str:
        executable = await cache.fetch(uri, TOOL_SHA)
        spec = AttemptSpec(executable, tmp_path / "w", tmp_path / "a.log", 1, 1, 1)
        return (await run_attempt(spec)).log_tail

    assert _run(fetch_then_run()) == "fetched and run\n"


def test_a_second_fetch_reuses_the_cached_copy(tmp_path: Path) -> None:
    source, uri = _source(tmp_path)
    cache = ArtifactCache(tmp_path / "cache")
    first = _run(cache.fetch(uri, TOOL_SHA))
    inode = first.stat().st_ino
    source.unlink()

    again = _run(cache.fetch(uri, TOOL_SHA))
    after_restart = _run(ArtifactCache(tmp_path / "cache").fetch(uri, TOOL_SHA))

    assert again == after_restart == first
    assert first.stat().st_ino == inode


def test_a_corrupted_cache_entry_is_fetched_again(tmp_path: Path) -> None:
    _, uri = _source(tmp_path)
    path = _run(ArtifactCache(tmp_path / "cache").fetch(uri, TOOL_SHA))
    path.write_bytes(b"#!/bin/sh\nrm -rf /\n")

    again = _run(ArtifactCache(tmp_path / "cache").fetch(uri, TOOL_SHA))

    assert again.read_bytes() == TOOL


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("file:///nonexistent/tool", "cannot read /nonexistent/tool: no such file"),
        ("ftp://example.com/tool", "unsupported artifact scheme 'ftp'"),
        ("http://127.0.0.1:9/tool", "http:// only with allow_insecure_http"),
        ("s3://bucket-only", "not an s3://bucket/key URI"),
    ],
)
def test_unusable_uris_are_not_retryable(tmp_path: Path, uri: str, message: str) -> None:
    with pytest.raises(ArtifactError, match=message) as caught:
        _run(ArtifactCache(tmp_path / "cache").fetch(uri, TOOL_SHA))

    assert caught.value.retryable is False


def test_a_malformed_digest_is_refused(tmp_path: Path) -> None:
    _, uri = _source(tmp_path)

    with pytest.raises(ArtifactError, match="not a sha256 digest"):
        _run(ArtifactCache(tmp_path / "cache").fetch(uri, "../../etc/passwd"))


def test_http_download_with_allow_insecure_http(tmp_path: Path, server: _Server) -> None:
    server.routes["/tool"] = (200, TOOL)
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)

    path = _run(cache.fetch(f"{server.base}/tool", TOOL_SHA))

    assert path.read_bytes() == TOOL


def test_downloads_share_one_client_and_its_connection_until_close(
    tmp_path: Path, server: _Server
) -> None:
    """Every http(s) download of a cache goes over one pooled client: three artifacts, one
    TCP connection (a client per download would open three); closing the cache closes it."""
    bodies = {f"/tool{i}": TOOL + bytes([i]) for i in range(3)}
    server.routes = {path: (200, body) for path, body in bodies.items()}
    server.keep_alive = True
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)

    async def three_then_close() -> None:
        for path, body in bodies.items():
            got = await cache.fetch(f"{server.base}{path}", hashlib.sha256(body).hexdigest())
            assert got.read_bytes() == body
        assert server.connections == 1
        await cache.aclose()

    _run(three_then_close())

    deadline = time.monotonic() + 5
    while server.open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (server.connections, server.open) == (1, 0)


def test_a_shared_connection_carries_no_download_s_cookie_or_credentials(
    tmp_path: Path, server: _Server
) -> None:
    """A cookie one answer sets and one URI's user:password are not sent with the
    downloads after it over the same connection."""
    bodies = {path: TOOL + path.encode() for path in ("/a", "/b", "/c")}
    server.routes = {path: (200, body) for path, body in bodies.items()}
    server.cookies["/a"] = "session=secret; Path=/"
    server.keep_alive = True
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)
    authed = server.base.replace("http://", "http://user:pw@")

    async def three() -> None:
        for base, path in ((server.base, "/a"), (authed, "/b"), (server.base, "/c")):
            await cache.fetch(f"{base}{path}", hashlib.sha256(bodies[path]).hexdigest())
        await cache.aclose()

    _run(three())

    assert server.connections == 1
    assert server.seen["/b"]["authorization"].startswith("Basic ")
    assert "cookie" not in server.seen["/b"]
    assert "authorization" not in server.seen["/c"] and "cookie" not in server.seen["/c"]


@pytest.mark.parametrize(("status", "retryable"), [(404, False), (403, False), (503, True)])
def test_http_errors_say_whether_to_retry(
    tmp_path: Path, server: _Server, status: int, retryable: bool
) -> None:
    server.routes["/tool"] = (status, b"no")
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)

    with pytest.raises(ArtifactError, match=f"HTTP {status}") as caught:
        _run(cache.fetch(f"{server.base}/tool", TOOL_SHA))

    assert caught.value.retryable is retryable
    assert _files(tmp_path / "cache") == []


def test_an_unreachable_server_is_retryable(tmp_path: Path, server: _Server) -> None:
    base = server.base
    server.httpd.shutdown()
    server.httpd.server_close()
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)

    with pytest.raises(ArtifactError, match="ConnectError") as caught:
        _run(cache.fetch(f"{base}/tool", TOOL_SHA))

    assert caught.value.retryable is True


def test_artifacts_over_the_size_cap_are_refused(tmp_path: Path, server: _Server) -> None:
    server.routes["/tool"] = (200, TOOL)
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True, max_bytes=10)

    with pytest.raises(ArtifactError, match="larger than the 10 byte limit") as caught:
        _run(cache.fetch(f"{server.base}/tool", TOOL_SHA))

    assert caught.value.retryable is False


def test_the_size_cap_holds_without_a_content_length(tmp_path: Path) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield TOOL[:10]
        yield TOOL[10:]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chunks())

    cache = ArtifactCache(tmp_path / "cache", max_bytes=12, transport=httpx.MockTransport(handler))

    with pytest.raises(ArtifactError, match="larger than the 12 byte limit"):
        _run(cache.fetch("https://artifacts.test/tool", TOOL_SHA))
    assert _files(tmp_path / "cache") == []


def test_https_errors_do_not_show_presigned_query_strings(tmp_path: Path) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(404))
    cache = ArtifactCache(tmp_path / "cache", transport=transport)

    with pytest.raises(ArtifactError) as caught:
        _run(cache.fetch("https://artifacts.test/tool?X-Amz-Signature=secret", TOOL_SHA))

    assert caught.value.reason == "GET https://artifacts.test/tool: HTTP 404"


def test_concurrent_fetches_of_one_digest_download_once(tmp_path: Path, server: _Server) -> None:
    server.routes["/tool"] = (200, TOOL)
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)

    async def many() -> list[Path]:
        return list(
            await asyncio.gather(*(cache.fetch(f"{server.base}/tool", TOOL_SHA) for _ in range(10)))
        )

    paths = _run(many())

    assert len(set(paths)) == 1
    assert server.hits == {"/tool": 1}
    assert _files(tmp_path / "cache") == [paths[0]]


def test_two_caches_on_one_root_cannot_corrupt_each_other(tmp_path: Path) -> None:
    body = os.urandom(4 << 20)
    digest = hashlib.sha256(body).hexdigest()
    _, uri = _source(tmp_path, body)

    async def race() -> list[Path]:
        caches = [ArtifactCache(tmp_path / "cache") for _ in range(4)]
        return list(await asyncio.gather(*(c.fetch(uri, digest) for c in caches)))

    paths = _run(race())

    assert len(set(paths)) == 1
    assert hashlib.sha256(paths[0].read_bytes()).hexdigest() == digest
    assert _files(tmp_path / "cache") == [paths[0]]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "CAIRN_S3_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    client = importlib.import_module("boto3").client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="tools")
    return client


def test_s3_artifact_is_downloaded_and_verified(tmp_path: Path, s3: Any) -> None:
    s3.put_object(Bucket="tools", Key="team/tool v1.sh", Body=TOOL)
    cache = ArtifactCache(tmp_path / "cache", s3_own_buckets=frozenset({"tools"}))

    path = _run(cache.fetch("s3://tools/team/tool v1.sh", TOOL_SHA))

    assert path.read_bytes() == TOOL
    with pytest.raises(ArtifactError, match="sha256 mismatch") as caught:
        _run(cache.fetch("s3://tools/team/tool v1.sh", WRONG_SHA))
    assert caught.value.retryable is False


def test_a_missing_s3_object_is_not_retryable(tmp_path: Path, s3: Any) -> None:
    with pytest.raises(ArtifactError, match="NoSuchKey") as caught:
        cache = ArtifactCache(tmp_path / "cache", s3_own_buckets=frozenset({"*"}))
        _run(cache.fetch("s3://tools/absent", TOOL_SHA))

    assert caught.value.retryable is False


# --- what attempts run: private copies, verified at every start -----------------------


def test_a_cached_artifact_changed_after_its_check_is_fetched_again_before_it_runs(
    tmp_path: Path, server: _Server
) -> None:
    server.routes["/tool"] = (200, TOOL)
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)
    uri = f"{server.base}/tool"
    first = _run(cache.materialize(uri, TOOL_SHA, tmp_path))
    cached = cache.path_for(TOOL_SHA)
    cached.write_bytes(b"#!/bin/sh\necho evil\n")  # changed behind the cache's back

    second = _run(cache.materialize(uri, TOOL_SHA, tmp_path))

    assert first.read_bytes() == second.read_bytes() == TOOL
    assert server.hits["/tool"] == 2 and cached.read_bytes() == TOOL


def test_a_verified_cached_artifact_is_copied_without_hashing_until_it_changes(
    tmp_path: Path, server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.routes["/tool"] = (200, TOOL)
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)
    uri = f"{server.base}/tool"
    hashed: list[int] = []
    real = artifacts._Sink.write
    monkeypatch.setattr(artifacts._Sink, "write", lambda s, c: (hashed.append(1), real(s, c)))
    _run(cache.materialize(uri, TOOL_SHA, tmp_path))
    after_first = len(hashed)
    again = _run(cache.materialize(uri, TOOL_SHA, tmp_path))
    assert again.read_bytes() == TOOL and len(hashed) == after_first  # no second hash
    cached = cache.path_for(TOOL_SHA)
    same_size = b"#" * len(TOOL)
    cached.write_bytes(same_size)  # same size, new content and modification time

    third = _run(cache.materialize(uri, TOOL_SHA, tmp_path))

    assert third.read_bytes() == TOOL and server.hits["/tool"] == 2


def test_a_file_artifact_is_copied_from_its_source_at_every_start(tmp_path: Path) -> None:
    source, uri = _source(tmp_path)
    cache = ArtifactCache(tmp_path / "cache")
    assert _run(cache.materialize(uri, TOOL_SHA, tmp_path)).read_bytes() == TOOL
    source.write_bytes(b"#!/bin/sh\necho changed\n")

    with pytest.raises(ArtifactError, match="sha256 mismatch") as caught:
        _run(cache.materialize(uri, TOOL_SHA, tmp_path))

    assert TOOL_SHA not in str(caught.value)
    assert not (tmp_path / "cache").exists()  # file:// is never cached


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid's permissions needs root")
def test_a_file_artifact_is_opened_with_the_attempts_permissions(tmp_path: Path) -> None:
    from services.worker.isolation import Identity

    folder = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        folder.chmod(0o755)
        secret = folder / "secret.sh"
        secret.write_bytes(TOOL)
        secret.chmod(0o600)  # root's own
        cache = ArtifactCache(tmp_path / "cache")
        with pytest.raises(ArtifactError, match="not readable by the attempt") as caught:
            _run(cache.materialize(secret.as_uri(), "0" * 64, tmp_path, Identity(29999, 29999)))
        assert TOOL_SHA not in str(caught.value)
        secret.chmod(0o644)
        copy = _run(cache.materialize(secret.as_uri(), TOOL_SHA, tmp_path, Identity(29999, 29999)))
        assert copy.read_bytes() == TOOL
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("uri", ["file:///proc/self/environ", "file:///dev/zero"])
def test_kernel_files_are_never_artifacts(tmp_path: Path, uri: str) -> None:
    with pytest.raises(ArtifactError) as caught:
        _run(ArtifactCache(tmp_path / "cache").materialize(uri, TOOL_SHA, tmp_path))
    assert caught.value.retryable is False


def test_a_symlink_into_proc_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to("/proc/self/status")
    with pytest.raises(ArtifactError, match="not a regular file"):
        _run(ArtifactCache(tmp_path / "cache").materialize(link.as_uri(), TOOL_SHA, tmp_path))


def test_sources_outside_the_allow_list_are_refused_on_the_worker(tmp_path: Path) -> None:
    _, uri = _source(tmp_path)
    cache = ArtifactCache(tmp_path / "cache", sources=("s3://jobs/",))
    with pytest.raises(ArtifactError, match="not an allowed artifact source") as caught:
        _run(cache.materialize(uri, TOOL_SHA, tmp_path))
    assert caught.value.retryable is False


def test_the_cache_keeps_to_its_bound_least_recently_used_first(
    tmp_path: Path, server: _Server
) -> None:
    bodies = {name: f"#!/bin/sh\necho {name}\n".encode() * 20 for name in "abc"}
    for name, body in bodies.items():
        server.routes[f"/{name}"] = (200, body)
    size = len(bodies["a"])
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True, max_cache_bytes=2 * size)
    digests = {n: hashlib.sha256(b).hexdigest() for n, b in bodies.items()}
    for name in "ab":
        _run(cache.materialize(f"{server.base}/{name}", digests[name], tmp_path))
    past = time.time() - 100
    os.utime(cache.path_for(digests["a"]), (past, past))
    _run(cache.materialize(f"{server.base}/b", digests["b"], tmp_path))  # b used again
    _run(cache.materialize(f"{server.base}/c", digests["c"], tmp_path))

    assert not cache.path_for(digests["a"]).exists()
    assert cache.path_for(digests["b"]).exists() and cache.path_for(digests["c"]).exists()


def test_a_redirect_is_followed_only_to_an_allowed_source(tmp_path: Path, server: _Server) -> None:
    """Each hop is checked against the allow-list before it is asked; a refused one is
    a failure no retry mends, naming both URIs without their queries."""
    allowed = f"{server.base}/jobs/"
    server.routes["/jobs/real"] = (200, TOOL)
    server.redirects = {
        "/jobs/tool?sig=secret": f"{allowed}real",
        "/jobs/away": f"{server.base}/elsewhere/tool?sig=secret",
    }
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True, sources=(allowed,))

    assert _run(cache.fetch(f"{allowed}tool?sig=secret", TOOL_SHA)).read_bytes() == TOOL
    with pytest.raises(ArtifactError, match="not an allowed artifact source") as caught:
        _run(cache.fetch(f"{allowed}away", WRONG_SHA))

    assert caught.value.retryable is False
    assert f"redirected to {server.base}/elsewhere/tool," in caught.value.reason
    assert "secret" not in caught.value.reason
    assert "/elsewhere/tool?sig=secret" not in server.hits


def test_redirects_are_followed_a_bounded_number_of_times(tmp_path: Path, server: _Server) -> None:
    server.redirects = {f"/r{i}": f"{server.base}/r{i + 1}" for i in range(10)}
    server.routes["/r10"] = (200, TOOL)
    cache = ArtifactCache(tmp_path / "cache", allow_insecure_http=True)

    with pytest.raises(ArtifactError, match=f"more than {artifacts.MAX_REDIRECTS} redirects"):
        _run(cache.fetch(f"{server.base}/r0", TOOL_SHA))

    assert "/r10" not in server.hits
