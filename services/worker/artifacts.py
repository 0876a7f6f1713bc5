"""The worker's artifact cache: executables fetched by URI, kept by their sha256.

An artifact lives at ``root/<sha256[:2]>/<sha256>``, mode 0755. A download goes to a
temporary file in the same directory and becomes visible only by an atomic rename, after
its digest has been checked, so a reader never sees a partial or wrong file, and two
fetches of the same digest (in one process or several) cannot corrupt each other.

The cache belongs to the agent (its folders are 0700): attempts never see it. What an
attempt runs is a private copy (``materialize``). The first copy of a cached artifact in
this process is hashed while it is written; later copies are made by the kernel
(``copy_file_range``, no pass through Python) for as long as the cached file is the same
file it was when hashed (device, inode, size, modification time: only the agent can write
the cache, so a change shows there), and hashed again otherwise. A ``file://`` artifact is
opened with the attempt's own permissions (its uid, its gid, no other groups), every time,
and is not cached. An attempt of another uid than the agent's runs a ``Sealed`` copy through
a hard link rather than a copy of its own: made as above once per digest, then linked while
it is the file that was hashed. A ``file://`` source is still opened as the attempt at
every start, and hashed again unless ``FileStamps`` holds that the file it opened (its
device, inode, size, modification and change times) was hashed to that digest already and
is provably unchanged since (docs/security.md, "Verifying a file:// artifact"). No error
names a digest the agent computed, so a mismatch is no oracle for a file's content. The
cache is bounded (``max_cache_bytes``): the least recently used artifacts are removed
first, never one being copied.

An ``s3://`` artifact is fetched with the credentials its task names (``artifact.credentials``,
a secret of its owner or team that core opens into the lease: ``S3Credentials``), by a client
made for those credentials (a few are kept, by a digest of them); the worker's own
credentials (boto3's chain: its role, its environment) sign a fetch only from a bucket the
operator lists in ``s3_own_buckets`` (``CAIRN_WORKER_S3_OWN_BUCKETS``; ``*``: any bucket).
Anything else fails at once, naming the bucket and the setting: the worker is nobody's
deputy for objects only its own role may read (docs/security.md, "Artifact credentials").

The cache is no way around that rule, by construction rather than by a check: an ``s3://``
artifact is kept under a name derived from its bucket, the credentials that fetched it (a
digest of them, or the worker's own) and its digest (``_entry``), so a hit needs the same
bucket and the same credentials, and so an attempt gets a cached copy only where its own
fetch would have been allowed; naming a digest that another owner's credentials fetched
finds nothing and fetches with its own (which fail if they may not read it). New
credentials (a rotated key) fetch once more. ``https://`` artifacts (fetched with no
credentials: anyone may fetch them again) keep the digest as their name, and a sealed copy
of a ``file://`` artifact is named apart from them (opened as each attempt anyway). A cache
made before names were scoped is emptied once (``_forget_unscoped``).

An ``https://`` download follows at most ``MAX_REDIRECTS`` redirects (a presigned URL, a
release asset), each hop checked as the first URI was, before it is asked:
``CAIRN_ARTIFACT_SOURCES`` must allow it too, and https never leads to plain http. A refused
hop is a failure no retry mends, naming both URIs (without their queries).

    ArtifactError        the artifact cannot be had; ``retryable`` says whether a later
                         attempt may fare better (network trouble, a 5xx) or not (a digest
                         mismatch, a missing object, an unsupported scheme, over the size cap)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import fcntl
import hashlib
import http.cookiejar
import importlib
import os
import platform
import queue
import signal
import stat
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from libs.common.models import S3Credentials
from libs.common.sources import redact_url, source_allowed
from services.worker.isolation import Identity
from services.worker.settings import SOURCE_TIMEOUT_S

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
#: redirects followed at most (a presigned URL, a release download: one or two hops)
MAX_REDIRECTS = 5
CHUNK = 1 << 20
#: opens that did not answer in time and still wait in the kernel (a FUSE mount whose
#: server hangs): at most this many threads are left to them (``_Guard``)
MAX_STUCK_OPENS = 4
_TRANSIENT_HTTP = frozenset({408, 425, 429})
_MISSING_S3 = frozenset({"NoSuchKey", "NoSuchBucket", "404", "AccessDenied", "403"})
#: S3 clients kept for artifacts' own credentials, the least recently used dropped first
MAX_S3_CLIENTS = 32
#: the folder in the cache that says its entries have scoped names (``_forget_unscoped``)
SCOPED = ".scoped-names"
#: the setting that lists the buckets the worker's own credentials may fetch from
OWN_BUCKETS_SETTING = "CAIRN_WORKER_S3_OWN_BUCKETS"
#: files no artifact may come from: the kernel's views of processes and devices
_PSEUDO = ("/proc/", "/sys/", "/dev/")
#: the download client's cookie policy: no cookie is kept or sent (``ArtifactCache._http``)
_NO_COOKIES = http.cookiejar.DefaultCookiePolicy(allowed_domains=[])
#: keep-alive connections the download client keeps open between downloads
MAX_IDLE_CONNECTIONS = 20
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


class ArtifactError(Exception):
    """The artifact could not be fetched."""

    def __init__(self, reason: str, *, retryable: bool) -> None:
        self.reason = reason
        self.retryable = retryable
        super().__init__(reason)


class _Sink:
    """Writes a download, hashing and counting as it goes; refuses more than ``limit``."""

    def __init__(self, out: IO[bytes] | None, limit: int) -> None:
        self.out = out
        self._limit = limit
        self._hash = hashlib.sha256()
        self.size = 0
        self.aborted = threading.Event()

    def write(self, chunk: bytes) -> None:
        if self.aborted.is_set():
            raise ArtifactError("download abandoned", retryable=True)
        self.size += len(chunk)
        if self.size > self._limit:
            raise ArtifactError(
                f"artifact is larger than the {self._limit} byte limit", retryable=False
            )
        self._hash.update(chunk)
        if self.out is not None:  # None: hashed only (``ArtifactCache.seal_local``)
            self.out.write(chunk)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class ArtifactCache:
    """A content-addressed cache of executables under ``root``.

    ``allow_insecure_http`` admits ``http://`` URIs (for tests and trusted networks; the
    digest still guards the content). ``s3_endpoint_url`` defaults to the environment's
    ``CAIRN_S3_ENDPOINT_URL`` (credentials may name another). ``s3_own_buckets``: the
    buckets fetched from with the worker's own credentials (boto3's usual chain) when an
    artifact names none (``*``: every bucket); none by default.
    """

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        s3_endpoint_url: str | None = None,
        allow_insecure_http: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
        sources: tuple[str, ...] = (),
        max_cache_bytes: int | None = None,
        s3_own_buckets: frozenset[str] = frozenset(),
        open_timeout_s: float = SOURCE_TIMEOUT_S,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        #: a ``file://`` source's open (as the attempt) that has not answered by then fails
        #: the attempt (``_Guard``)
        self.open_timeout_s = open_timeout_s
        self.sources = sources
        self.max_cache_bytes = max_cache_bytes
        self._copying: collections.Counter[str] = collections.Counter()
        self._timeout = timeout
        self._s3_endpoint_url = s3_endpoint_url or os.environ.get("CAIRN_S3_ENDPOINT_URL")
        self._allow_http = allow_insecure_http
        self._transport = transport
        #: the one client every http(s) download goes through (``_http``), its event loop
        self._client: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._verified: set[str] = set()
        self._fingerprints: dict[str, tuple[int, int, int, int]] = {}
        self._s3_own_buckets = s3_own_buckets
        self._s3_clients: OrderedDict[str, Any] = OrderedDict()
        self._s3_lock = threading.Lock()
        self.stamps = FileStamps()
        #: ``sealed_known``'s digest, sealed copy's name and path of a ``file://`` source
        #: (a pure function of the URI, digest and allowed sources), kept as ``stamps``
        self._named: dict[tuple[str, str, tuple[str, ...]], tuple[str, str, Path]] = {}
        #: ``file://`` sources whose last seal found them on a local file system, hashed
        #: and sealed (``sealed_known`` opens only those)
        self._local_uris: dict[str, Stamp | None] = {}
        self._local_lock = threading.Lock()
        self._forget_unscoped()

    def _forget_unscoped(self) -> None:
        """Remove, once, what a cache of before scoped names (``_entry``) holds: it named
        an ``s3://`` artifact by its digest alone, where an ``https://`` one of that
        digest would find it now. ``SCOPED`` (a folder) says it was done."""
        if not self.root.is_dir() or (self.root / SCOPED).is_dir():
            return
        for path in self.root.glob("??/" + "?" * 64):
            path.unlink(missing_ok=True)
        (self.root / SCOPED).mkdir(mode=0o700, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        """Where the artifact with this digest is (or will be) kept."""
        return self.root / sha256[:2] / sha256

    async def fetch(
        self,
        uri: str,
        sha256: str,
        reader: Identity | None = None,
        credentials: S3Credentials | None = None,
    ) -> Path:
        """The local path of the artifact at ``uri``, downloaded unless already cached;
        a ``file://`` source is opened as ``reader`` when given, an ``s3://`` one fetched
        with ``credentials`` (or, in ``s3_own_buckets``, the worker's own).

        Raises ``ArtifactError`` when it cannot be had or its digest is not ``sha256``.
        """
        digest = _digest(sha256)
        if not source_allowed(uri, self.sources):
            raise ArtifactError(
                f"{redact_url(uri)} is not an allowed artifact source", retryable=False
            )
        entry = self._entry(uri, digest, credentials)
        final = self.path_for(entry)
        lock = self._locks.get(entry)
        if lock is None:
            lock = self._locks[entry] = asyncio.Lock()
        async with lock:
            if await self._usable(final, entry, digest):
                return final
            await self._download(uri, digest, final, reader, credentials)
            self._verified.add(entry)
            self._evict(keep=entry)
            return final

    def _entry(self, uri: str, digest: str, credentials: S3Credentials | None) -> str:
        """The cache's name for this artifact (the module's docstring says why): its
        digest, or for ``s3://`` one derived from the bucket, the credentials and the
        digest, once the fetch is known to be allowed (``_s3_allowed``)."""
        if _scheme(uri) != "s3":
            return digest
        bucket = self._s3_allowed(uri, credentials)
        scope = "worker" if credentials is None else _credentials_key(credentials)
        return hashlib.sha256(f"cairn-s3\x00{bucket}\x00{scope}\x00{digest}".encode()).hexdigest()

    def _s3_allowed(self, uri: str, credentials: S3Credentials | None) -> str:
        """The bucket of ``uri``, if this fetch may be made: with the artifact's own
        credentials, or from a bucket the worker's own credentials serve anyone."""
        bucket, _, key = uri[len("s3://") :].partition("/")
        if not bucket or not key:
            raise ArtifactError(f"not an s3://bucket/key URI: {uri!r}", retryable=False)
        if credentials is not None:
            endpoint = credentials.endpoint
            if endpoint is None:
                return bucket
            if endpoint.startswith("http://") and not self._allow_http:
                raise ArtifactError(
                    "artifact.credentials: an http:// endpoint is not allowed here (https only)",
                    retryable=False,
                )
            # The worker connects where the endpoint says: a source like any other.
            if not source_allowed(endpoint.rstrip("/") + "/", self.sources):
                raise ArtifactError(
                    "artifact.credentials: its endpoint is not an allowed artifact source "
                    "(CAIRN_ARTIFACT_SOURCES)",
                    retryable=False,
                )
            return bucket
        if "*" in self._s3_own_buckets or bucket in self._s3_own_buckets:
            return bucket
        raise ArtifactError(
            f"s3 bucket {bucket!r} is not one the worker fetches from with its own "
            f"credentials ({OWN_BUCKETS_SETTING}): name credentials for the artifact "
            "(artifact.credentials, a secret holding S3 keys)",
            retryable=False,
        )

    async def materialize(
        self,
        uri: str,
        sha256: str,
        folder: Path,
        reader: Identity | None = None,
        credentials: S3Credentials | None = None,
    ) -> Path:
        """A private copy of the artifact in ``folder``, checked against ``sha256`` as it
        is written (so what runs is verified now, not trusted from an earlier check).
        ``file://`` artifacts are copied straight from their source, opened as ``reader``.
        """
        digest = _digest(sha256)
        if not source_allowed(uri, self.sources):
            raise ArtifactError(
                f"{redact_url(uri)} is not an allowed artifact source", retryable=False
            )
        if _scheme(uri) == "file":
            sink = _Sink(None, self.max_bytes)
            limit = self.open_timeout_s
            return await _in_thread(
                sink, lambda: _copy_local(uri, digest, folder, reader, sink, limit)
            )
        entry = self._entry(uri, digest, credentials)
        self._copying[entry] += 1
        try:
            for tries_left in (1, 0):
                cached = await self.fetch(uri, digest, credentials=credentials)
                seen = _fingerprint(cached)
                if seen is not None:
                    with contextlib.suppress(OSError):
                        # Used now: last in the eviction order (its mtime is kept).
                        os.utime(cached, ns=(time.time_ns(), seen[3]))
                if seen is not None and self._fingerprints.get(entry) == seen:
                    copy = await asyncio.to_thread(_copy_same, cached, folder, seen)
                    if copy is not None:
                        return copy
                    self._fingerprints.pop(entry, None)  # changed: hashed again below
                try:
                    copy = await self._copy_checked(_copier(cached), uri, digest, folder, entry)
                    if seen is not None and _fingerprint(cached) == seen:
                        self._fingerprints[entry] = seen
                    return copy
                except ArtifactError:
                    # The cached copy changed since it was checked: it is gone now,
                    # and fetched again once.
                    if not tries_left:
                        raise
            raise AssertionError("unreachable")
        finally:
            self._copying[entry] -= 1

    def copy_local(
        self, uri: str, sha256: str, folder: Path, reader: Identity | None = None
    ) -> Path:
        """``materialize`` of a ``file://`` artifact in the calling thread, which it blocks
        (for a worker thread that prepares the rest of the attempt's folders as well)."""
        digest = _digest(sha256)
        if not source_allowed(uri, self.sources) or _scheme(uri) != "file":
            raise ArtifactError(
                f"{redact_url(uri)} is not an allowed artifact source", retryable=False
            )
        sink = _Sink(None, self.max_bytes)
        return _copy_local(uri, digest, folder, reader, sink, self.open_timeout_s)

    def seal_local(self, uri: str, sha256: str, reader: Identity, sealed: Sealed) -> Path:
        """The sealed copy (``Sealed``) of a ``file://`` artifact: its source is opened as
        ``reader`` at every call, as ``copy_local`` does, and hashed unless ``stamps``
        holds that this very file, unchanged since, was hashed to ``sha256`` already;
        written only when no sealed copy of that digest exists (then while it is hashed).
        What the attempt runs is always the sealed copy, never the source's path."""
        digest, name = self._local_name(uri, sha256)
        known = sealed.get(name)
        source = _local_path(uri)
        with os.fdopen(_open_source(source, reader, self.open_timeout_s), "rb") as src:
            stamp = _stamp(src.fileno())
            if known is not None and self.stamps.holds(stamp, digest):
                self._local(uri, stamp)
                return known
            quiet = stamp is not None and self.stamps.quiet(stamp) and _no_writer(src.fileno())
            sink = _Sink(None, self.max_bytes)
            written = None
            guarded = _guarded(source, reader, self.open_timeout_s)
            if known is None:
                written = _write_copy(sealed.folder, sink, lambda: _read_into(src, sink, guarded))
            else:
                _read_into(src, sink, guarded)
            if sink.hexdigest() != digest:
                if written is not None:
                    written.unlink(missing_ok=True)
                raise ArtifactError(_mismatch(uri), retryable=False)
            if quiet and stamp is not None and _stamp(src.fileno()) == stamp:
                self.stamps.remember(stamp, digest)
                self._local(uri, stamp)
        if written is not None:
            return sealed.add(name, written)
        assert known is not None  # one of the two: read into the sealed copy, or a new one
        return known

    def sealed_known(self, uri: str, sha256: str, reader: Identity, sealed: Sealed) -> Path | None:
        """``seal_local`` for a caller that must not block long (the event loop): its
        sealed copy where that needs no read of the source, else None, having read and
        written nothing. It opens only a source that the last seal of ``uri`` found on a
        local file system (no network file system's open on the loop), whose sealed copy
        holds, as ``reader`` on the calling thread (``open_as_here`` first)."""
        if uri not in self._local_uris:
            return None
        digest, name, source = self._named_local(uri, sha256)
        known = sealed.get(name)
        if known is None:
            return None
        fd = _open_known(source, reader, self.open_timeout_s)
        try:
            if self.stamps.holds(_stamp(fd), digest):
                return known
        finally:
            os.close(fd)
        with self._local_lock:
            self._local_uris.pop(uri, None)  # hashed again, in a thread
        return None

    def sealed_stamp(
        self, uri: str, sha256: str, sealed: Sealed
    ) -> tuple[Path, Path, Stamp] | None:
        """``sealed_known`` without the open, for a start whose spawn helper checks the
        source itself (``spawner.Launch.source``): the sealed copy, the source's path and
        the stamp its last seal found it with, where that stamp holds ``sha256``; None
        otherwise. The check left to the helper is the one ``sealed_known`` makes: the
        source opened as the attempt has that stamp (else ``forget_local``, and
        ``seal_local`` again)."""
        stamp = self._local_uris.get(uri)
        if stamp is None:
            return None
        digest, name, source = self._named_local(uri, sha256)
        known = sealed.get(name)
        if known is None or not self.stamps.holds(stamp, digest):
            return None
        return known, source, stamp

    def forget_local(self, uri: str) -> None:
        """The source of ``uri`` is no longer the file of its last stamp: sealed again."""
        with self._local_lock:
            self._local_uris.pop(uri, None)

    def _named_local(self, uri: str, sha256: str) -> tuple[str, str, Path]:
        key = (uri, sha256, self.sources)
        named = self._named.get(key)
        if named is None:
            named = (*self._local_name(uri, sha256), _local_path(uri))
            if len(self._named) >= self.stamps.max_entries:
                self._named.clear()
            self._named[key] = named
        return named

    def _local_name(self, uri: str, sha256: str) -> tuple[str, str]:
        """The digest, and the name of the sealed copy of a ``file://`` artifact; raises
        ``ArtifactError`` if its source is not allowed."""
        digest = _digest(sha256)
        if not source_allowed(uri, self.sources) or _scheme(uri) != "file":
            raise ArtifactError(
                f"{redact_url(uri)} is not an allowed artifact source", retryable=False
            )
        # Named apart from fetched artifacts: an https:// attempt naming this digest must
        # not get a copy of a file only this reader may open.
        return digest, hashlib.sha256(f"cairn-file\x00{digest}".encode()).hexdigest()

    def _local(self, uri: str, stamp: Stamp | None = None) -> None:
        """``uri``'s source is on a local file system, hashed (bounded as ``stamps``),
        with the stamp it had (``sealed_stamp``)."""
        with self._local_lock:
            self._local_uris.pop(uri, None)
            self._local_uris[uri] = stamp
            while len(self._local_uris) > self.stamps.max_entries:
                del self._local_uris[next(iter(self._local_uris))]

    async def seal(
        self, uri: str, sha256: str, sealed: Sealed, credentials: S3Credentials | None = None
    ) -> Path:
        """The sealed copy of a fetched artifact, made from the cache (``materialize``)
        when none is known, then used while its fingerprint holds; named as the cache
        names it (``_entry``), so it is shared on the same terms."""
        digest = _digest(sha256)
        if not source_allowed(uri, self.sources):
            raise ArtifactError(
                f"{redact_url(uri)} is not an allowed artifact source", retryable=False
            )
        entry = self._entry(uri, digest, credentials)
        known = sealed.get(entry)
        if known is not None:
            return known
        copy = await self.materialize(uri, digest, sealed.folder, credentials=credentials)
        return await asyncio.to_thread(sealed.add, entry, copy)

    async def _copy_checked(
        self, copy: Callable[[_Sink], None], uri: str, digest: str, folder: Path, entry: str
    ) -> Path:
        sink = _Sink(None, self.max_bytes)
        made: list[str] = []

        def write() -> None:
            # The file made in the thread too: creating it may wait on the journal.
            fd, name = tempfile.mkstemp(dir=folder, prefix=".copy.")
            made.append(name)
            with os.fdopen(fd, "wb") as out:
                sink.out = out
                copy(sink)

        try:
            await _in_thread(sink, write)
            [name] = made
            if sink.hexdigest() != digest:
                if _scheme(uri) != "file":
                    self._verified.discard(entry)
                    self._fingerprints.pop(entry, None)
                    self.path_for(entry).unlink(missing_ok=True)
                raise ArtifactError(_mismatch(uri), retryable=_scheme(uri) != "file")
        except BaseException:
            for name in made:
                Path(name).unlink(missing_ok=True)
            raise
        return Path(name)

    def _evict(self, keep: str) -> None:
        """Remove least recently used artifacts until the cache fits its bound."""
        if self.max_cache_bytes is None:
            return
        entries = []
        for path in self.root.glob("??/" + "?" * 64):
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            entries.append((info.st_atime, info.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_cache_bytes:
                return
            if path.name == keep or self._copying[path.name] > 0:
                continue
            path.unlink(missing_ok=True)
            self._verified.discard(path.name)
            self._fingerprints.pop(path.name, None)
            total -= size

    async def _usable(self, final: Path, entry: str, digest: str) -> bool:
        """Whether the cached copy can be used; checked against its digest once a process."""
        if not final.exists():
            self._verified.discard(entry)
            return False
        if entry in self._verified:
            return True
        if await asyncio.to_thread(_file_digest, final) == digest:
            self._verified.add(entry)
            return True
        final.unlink(missing_ok=True)
        return False

    async def _download(
        self,
        uri: str,
        digest: str,
        final: Path,
        reader: Identity | None = None,
        credentials: S3Credentials | None = None,
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.root / SCOPED).mkdir(exist_ok=True, mode=0o700)
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name[:16]}.", suffix=".part")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                sink = _Sink(out, self.max_bytes)
                await self._fetch_into(uri, sink, reader, credentials)
                out.flush()
                os.fsync(out.fileno())
            if sink.hexdigest() != digest:
                raise ArtifactError(_mismatch(uri), retryable=False)
            tmp.chmod(0o755)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    async def _fetch_into(
        self,
        uri: str,
        sink: _Sink,
        reader: Identity | None = None,
        credentials: S3Credentials | None = None,
    ) -> None:
        scheme = _scheme(uri)
        if scheme == "file":
            limit = self.open_timeout_s
            await _in_thread(sink, lambda: _copy_file(_local_path(uri), sink, reader, limit))
        elif scheme == "https" or (scheme == "http" and self._allow_http):
            await self._download_http(uri, sink)
        elif scheme == "s3":
            await _in_thread(sink, lambda: self._download_s3(uri, sink, credentials))
        else:
            allowed = "https://, s3:// or file://"
            if scheme == "http":
                allowed += " (http:// only with allow_insecure_http)"
            raise ArtifactError(
                f"unsupported artifact scheme {scheme or uri!r}: expected {allowed}",
                retryable=False,
            )

    async def _download_http(self, uri: str, sink: _Sink) -> None:
        shown = redact_url(uri)
        try:
            async with self._follow(self._http(), uri) as response:
                if response.status_code >= 400:
                    code = response.status_code
                    raise ArtifactError(
                        f"GET {shown}: HTTP {code}",
                        retryable=code >= 500 or code in _TRANSIENT_HTTP,
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_bytes:
                    raise ArtifactError(
                        f"artifact is larger than the {self.max_bytes} byte limit "
                        f"({declared} bytes)",
                        retryable=False,
                    )
                async for chunk in response.aiter_raw(CHUNK):
                    sink.write(chunk)
        except httpx.HTTPError as exc:
            raise ArtifactError(
                f"GET {shown}: {type(exc).__name__}: {exc}", retryable=True
            ) from exc

    def _http(self) -> httpx.AsyncClient:
        """The cache's one client, built on first use: its keep-alive connections serve
        every download, and a client's build (its TLS context, ~17 ms of CPU) is paid
        once. It follows no redirect (``_follow`` checks each hop) and keeps no cookie, so
        nothing one download is answered carries into another; a URI's user and password
        become that request's Authorization alone. A client is bound to its event loop:
        another loop (``asyncio.run`` again) gets a client of its own."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            client = httpx.AsyncClient(
                timeout=self._timeout,
                transport=self._transport,
                follow_redirects=False,
                cookies=http.cookiejar.CookieJar(_NO_COOKIES),
                # as many downloads at once as before (a client each), at most
                # ``MAX_IDLE_CONNECTIONS`` kept open between them
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=MAX_IDLE_CONNECTIONS
                ),
            )
            self._client = (loop, client)
        return self._client[1]

    async def aclose(self) -> None:
        """Close the download client's connections (the agent's shutdown; a test's before
        its event loop ends). One of another, ended loop is only dropped."""
        held, self._client = self._client, None
        if held is not None and held[0] is asyncio.get_running_loop():
            with contextlib.suppress(httpx.HTTPError, OSError):
                await held[1].aclose()

    @contextlib.asynccontextmanager
    async def _follow(self, client: httpx.AsyncClient, uri: str) -> AsyncIterator[httpx.Response]:
        """The answer at ``uri`` after at most ``MAX_REDIRECTS`` redirects, each hop's
        target checked (``_hop``) before it is asked: a redirect is a new source."""
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", uri) as response:
                target = response.headers.get("location")
                if not response.is_redirect or target is None:
                    yield response
                    return
                uri = self._hop(uri, urllib.parse.urljoin(uri, target))
        raise ArtifactError(
            f"GET {redact_url(uri)}: more than {MAX_REDIRECTS} redirects", retryable=False
        )

    def _hop(self, uri: str, target: str) -> str:
        """``target`` if a redirect from ``uri`` may be followed there: the allow-list
        holds for it as for the first URI, and https never leads to plain http."""
        refused = f"GET {redact_url(uri)} redirected to {redact_url(target)}"
        scheme = _scheme(target)
        if scheme == "http" and _scheme(uri) == "https":
            raise ArtifactError(f"{refused}: a downgrade from https to http", retryable=False)
        if scheme not in ("https", "http") or (scheme == "http" and not self._allow_http):
            raise ArtifactError(f"{refused}: not an https:// URI", retryable=False)
        if not source_allowed(target, self.sources):
            raise ArtifactError(
                f"{refused}, which is not an allowed artifact source", retryable=False
            )
        return target

    def _download_s3(self, uri: str, sink: _Sink, credentials: S3Credentials | None) -> None:
        bucket = self._s3_allowed(uri, credentials)
        key = uri[len("s3://") + len(bucket) + 1 :]
        botocore = importlib.import_module("botocore.exceptions")
        try:
            answer = self._s3(credentials).get_object(Bucket=bucket, Key=key)
            body = answer["Body"]
            if int(answer.get("ContentLength") or 0) > self.max_bytes:
                raise ArtifactError(
                    f"artifact is larger than the {self.max_bytes} byte limit", retryable=False
                )
            for chunk in iter(lambda: body.read(CHUNK), b""):
                sink.write(chunk)
        except botocore.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            raise ArtifactError(
                f"s3 GET {uri}: {code or exc}", retryable=code not in _MISSING_S3
            ) from exc
        except botocore.BotoCoreError as exc:
            raise ArtifactError(f"s3 GET {uri}: {exc}", retryable=True) from exc

    def _s3(self, credentials: S3Credentials | None) -> Any:
        """A client signing with ``credentials`` (the worker's own chain when None), kept
        by a digest of them, at most ``MAX_S3_CLIENTS``."""
        key = "worker" if credentials is None else _credentials_key(credentials)
        with self._s3_lock:
            client = self._s3_clients.get(key)
            if client is None:
                # boto3 is imported on first use: only workers that fetch from S3 need it.
                session = importlib.import_module("boto3").session.Session()
                if credentials is None:
                    client = session.client("s3", endpoint_url=self._s3_endpoint_url)
                else:
                    client = session.client(
                        "s3",
                        endpoint_url=credentials.endpoint or self._s3_endpoint_url,
                        region_name=credentials.region,
                        aws_access_key_id=credentials.access_key_id,
                        aws_secret_access_key=credentials.secret_access_key,
                        aws_session_token=credentials.session_token,
                    )
                self._s3_clients[key] = client
                while len(self._s3_clients) > MAX_S3_CLIENTS:
                    self._s3_clients.popitem(last=False)
            self._s3_clients.move_to_end(key)
            return client


class Sealed:
    """Verified executables that attempts run through a hard link, one per digest, so an
    attempt costs a ``link`` instead of a new file and a copy: each is the agent's, mode
    0555, in a folder of the agent's only (0700) on the run folder's file system, so no
    attempt (another uid, no capabilities) can write, chmod, replace or remove it, and
    none can reach it but through its own executable folder (``workdirs``: 0750, the
    agent's and the attempt's gid). Written while hashed (``ArtifactCache.seal_local``,
    ``seal``), and trusted afterwards only while it is the file that was hashed (device,
    inode, size, mode, owner, modification time): otherwise it is made again. At most
    ``max_bytes`` are kept, the least recently used removed first (an attempt running
    one keeps its inode until its folder is emptied; one bound on a placeholder is not
    removed until its attempt's folders are given back: ``hold``). Only for attempts of
    another uid:
    an attempt running as the agent could change a shared file, so it gets a copy."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self._known: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._paths: dict[str, Path] = {}  # of the digests known, made once each
        #: copies named by path by attempts not started yet (``hold``): never evicted
        self._held: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def get(self, digest: str) -> Path | None:
        """The sealed copy of ``digest``, if one is known and unchanged."""
        with self._lock:
            expected = self._known.get(digest)
            if expected is None:
                return None
            path = self._paths.get(digest)
            if path is None:
                path = self._paths[digest] = self.folder / digest
            if _sealed_print(path) != expected:
                del self._known[digest]
                self._paths.pop(digest, None)
                return None
            self._known.move_to_end(digest)
        return path

    def add(self, digest: str, written: Path) -> Path:
        """Seal a verified copy (``written``, in ``folder``) as the one of ``digest``."""
        path = self.folder / digest
        written.chmod(0o555)
        os.replace(written, path)
        seen = _sealed_print(path)
        with self._lock:
            if seen is not None:
                self._known[digest] = seen
                self._known.move_to_end(digest)
            self._evict()
        return path

    def hold(self, path: Path) -> Callable[[], None]:
        """Keep the sealed copy at ``path`` until the call returned is made: an attempt
        whose executable is bound on a placeholder names its copy by path alone (no link
        holds it) until its start binds it, and an eviction in between would fail that
        start. What is over the bound meanwhile is evicted at the last let-go. Raises
        ``FileNotFoundError`` if the copy was evicted already (by another thread's seal,
        since it was handed out)."""
        digest = path.name
        with self._lock:
            if digest not in self._known:
                raise FileNotFoundError(f"sealed copy {digest} evicted")
            self._held[digest] += 1
        once = [digest]

        def let_go() -> None:
            if not once:  # let go already
                return
            once.clear()
            with self._lock:
                self._held[digest] -= 1
                if self._held[digest] <= 0:
                    del self._held[digest]
                self._evict()

        return let_go

    def _evict(self) -> None:
        total = sum(fingerprint[2] for fingerprint in self._known.values())
        if total <= self.max_bytes:
            return
        for digest in list(self._known)[:-1]:  # the oldest first; the newest is kept
            if total <= self.max_bytes:
                break
            if digest in self._held:
                continue
            fingerprint = self._known.pop(digest)
            self._paths.pop(digest, None)
            (self.folder / digest).unlink(missing_ok=True)
            total -= fingerprint[2]


#: a ``file://`` source's identity and change stamp: (st_dev, st_ino, st_size,
#: st_mtime_ns, st_ctime_ns), from an ``fstat`` of the descriptor opened as the attempt
Stamp = tuple[int, int, int, int, int]
#: file systems whose stamps only this kernel sets (statfs's f_type): ext2/3/4, xfs,
#: btrfs, tmpfs, overlayfs. Not NFS, CIFS, 9p or FUSE, whose server says what it likes.
_LOCAL_FS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0x794C7630})
#: the same, as the spawn helper reads them (``spawner.Launch.source_types``)
LOCAL_FS_TYPES = ",".join(f"{kind:x}" for kind in sorted(_LOCAL_FS))
#: how old a source's last change must be before its digest is remembered (past any
#: timestamp granularity of ``_LOCAL_FS``: ext4 and xfs keep ns, but the kernel stamps
#: with a clock that ticks every few ms, and 128-byte ext inodes keep whole seconds)
QUIET_NS = 2_000_000_000
#: ``file://`` sources remembered at most, the least recently used forgotten first
MAX_STAMPS = 1024


class FileStamps:
    """The digests of ``file://`` sources hashed already, each under the ``Stamp`` the
    file had while it was hashed, so a start that finds the same stamp again skips the
    hash (docs/security.md, "Verifying a file:// artifact" says why it is sound): any
    write, truncate, chmod, chown, rename or link of the inode moves its ctime, which no
    unprivileged process can set, and a new file at the path is another inode. Only
    remembered when the stamp held from before the hash to after it, the last change is
    ``quiet_ns`` old (so a later change cannot share its timestamp), the file system is
    local (``_LOCAL_FS``) and no process had it open for writing (``_no_writer``: a
    writable shared mapping changes bytes without moving the stamp)."""

    def __init__(self, quiet_ns: int = QUIET_NS, max_entries: int = MAX_STAMPS) -> None:
        self.quiet_ns = quiet_ns
        self.max_entries = max_entries
        self._known: OrderedDict[tuple[int, int], tuple[Stamp, str]] = OrderedDict()
        self._lock = threading.Lock()

    def holds(self, stamp: Stamp | None, digest: str) -> bool:
        """Whether the file of this stamp was hashed to ``digest``, unchanged since."""
        if stamp is None:
            return False
        with self._lock:
            known = self._known.get(stamp[:2])
            if known is None:
                return False
            if known[0] != stamp:
                del self._known[stamp[:2]]  # changed: hashed again
                return False
            self._known.move_to_end(stamp[:2])
            return known[1] == digest

    def quiet(self, stamp: Stamp) -> bool:
        """Whether the file's last change is old enough to be told from the next one."""
        return stamp[4] <= time.time_ns() - self.quiet_ns

    def remember(self, stamp: Stamp, digest: str) -> None:
        with self._lock:
            self._known[stamp[:2]] = (stamp, digest)
            self._known.move_to_end(stamp[:2])
            while len(self._known) > self.max_entries:
                self._known.popitem(last=False)


def _stamp(fd: int) -> Stamp | None:
    """The open file's ``Stamp``, or None where the file system's stamps are not this
    kernel's own (``_LOCAL_FS``)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first, 120 bytes
    if _libc.fstatfs(fd, buf) != 0:
        return None
    if ctypes.c_long.from_buffer(buf).value not in _LOCAL_FS:
        return None
    info = os.fstat(fd)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _no_writer(fd: int) -> bool:
    """Whether no process has the file open for writing: a read lease is granted only
    then (and only on a read-only descriptor); it is released at once. A writer that
    came in that instant would signal us with SIGWINCH, ignored by default."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGWINCH)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:
        return False  # a writer (EAGAIN), or leases unavailable here: hashed each time
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


def _sealed_print(path: Path) -> tuple[int, ...] | None:
    try:
        info = path.stat(follow_symlinks=False)
    except OSError:
        return None
    if info.st_uid != os.geteuid() or info.st_mode != stat.S_IFREG | 0o555:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _copy_local(
    uri: str, digest: str, folder: Path, reader: Identity | None, sink: _Sink, limit_s: float
) -> Path:
    """A verified copy of a ``file://`` artifact in ``folder``, read as ``reader`` (its
    open answered within ``limit_s``)."""
    source = _local_path(uri)
    written = _write_copy(folder, sink, lambda: _copy_file(source, sink, reader, limit_s))
    if sink.hexdigest() != digest:
        written.unlink(missing_ok=True)
        raise ArtifactError(_mismatch(uri), retryable=False)
    return written


def _write_copy(folder: Path, sink: _Sink, read: Callable[[], None]) -> Path:
    """A new file in ``folder`` holding what ``read`` passes through ``sink``; removed if
    reading fails."""
    fd, name = tempfile.mkstemp(dir=folder, prefix=".copy.")
    try:
        with os.fdopen(fd, "wb") as out:
            sink.out = out
            read()
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


async def _in_thread(sink: _Sink, work: Callable[[], T]) -> T:
    """Run a blocking download in a thread; if we are cancelled, the thread stops soon."""
    try:
        return await asyncio.to_thread(work)
    except asyncio.CancelledError:
        sink.aborted.set()
        raise


def _local_path(uri: str) -> Path:
    parsed = urllib.parse.urlsplit(uri)
    if parsed.netloc not in ("", "localhost"):
        raise ArtifactError(f"file:// URI names another host: {uri!r}", retryable=False)
    return Path(urllib.request.url2pathname(parsed.path))


def _copier(cached: Path) -> Callable[[_Sink], None]:
    """Copies the agent's own cached file (opened as the agent: no time limit applies)."""
    return lambda sink: _copy_file(cached, sink)


def _copy_file(
    source: Path, sink: _Sink, reader: Identity | None = None, limit_s: float = SOURCE_TIMEOUT_S
) -> None:
    with os.fdopen(_open_source(source, reader, limit_s), "rb") as src:
        _read_into(src, sink, _guarded(source, reader, limit_s))


def _open_source(source: Path, reader: Identity | None, limit_s: float) -> int:
    """A descriptor of the regular file ``source``, opened with ``reader``'s permissions
    (``_open_as``, within ``limit_s``); the kernel's views (``_PSEUDO``) are refused, by
    name and by the name the descriptor resolved to through links."""
    unreadable = _unreadable(source)
    if str(source).startswith(_PSEUDO):
        raise unreadable
    try:
        fd = _open_as(source, reader, limit_s)
    except OSError:
        raise unreadable from None
    try:
        resolved = os.readlink(f"/proc/self/fd/{fd}")
        if not stat.S_ISREG(os.fstat(fd).st_mode) or resolved.startswith(_PSEUDO):
            raise ArtifactError(f"{source} is not a regular file", retryable=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_known(source: Path, reader: Identity | None, limit_s: float) -> int:
    """``_open_source`` for a source whose stamp is then checked against those
    remembered (``FileStamps.holds``): a stamp is remembered only for a file that passed
    ``_open_source``'s checks, and one that holds names that same file (device and inode),
    so they are not made again; only the name's."""
    if str(source).startswith(_PSEUDO):
        raise _unreadable(source)
    try:
        return _open_as(source, reader, limit_s)
    except OSError:
        raise _unreadable(source) from None


def _unreadable(source: Path) -> ArtifactError:
    return ArtifactError(
        f"cannot read {source}: no such file, or not readable by the attempt", retryable=False
    )


def _read_into(src: IO[bytes], sink: _Sink, guarded: tuple[Path, float] | None = None) -> None:
    """Every byte of ``src`` through ``sink``; ``guarded`` (a source opened as an attempt:
    its path and time limit), each read on a thread of ``_guard``'s, given up after that
    limit as its open is (a file system may answer an open and hang on a read)."""
    if guarded is None:
        for chunk in iter(lambda: src.read(CHUNK), b""):
            sink.write(chunk)
        return
    source, limit_s = guarded
    while chunk := _guard.read(source, src.fileno(), CHUNK, limit_s):
        sink.write(chunk)


def _guarded(source: Path, reader: Identity | None, limit_s: float) -> tuple[Path, float] | None:
    """How ``_read_into`` reads ``source``, opened as ``reader`` by ``_open_as``: on the
    guard's threads where its open was too."""
    if reader is None or getattr(_here, "in_place", False):
        return None
    return source, limit_s


def _open_as(source: Path, reader: Identity | None, limit_s: float) -> int:
    """Open ``source`` for reading with ``reader``'s permissions, so root's rights never
    apply: on a thread of ``_Guard``'s, waited for at most ``limit_s`` (else
    ``ArtifactError``), or on the calling thread itself after ``open_as_here``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if reader is None:
        return os.open(source, flags)
    if os.geteuid() != 0 or _SYS_SETGROUPS is None:
        raise PermissionError("cannot take the attempt's permissions here")
    if getattr(_here, "in_place", False):
        return _open_here(source, flags, reader)
    return _guard.open(source, flags, reader, limit_s)


#: per thread: ``refused`` is set once the thread opens files as attempts in place (its
#: supplementary groups dropped), None while it may, else why it may not
_here = threading.local()


def open_as_here() -> None:
    """From now on the calling thread opens files as attempts itself (``_open_as``), with
    no hand-off and no time limit: its supplementary groups are dropped, once, by the raw
    system call (per thread in Linux; glibc's ``setgroups`` would drop every thread's).
    The agent's loop thread does this for ``ArtifactCache.sealed_known`` (only where no
    spawn helper starts attempts, which checks the source itself, bounded); as root it
    needs no group."""
    _drop_groups()
    _here.in_place = True


def _drop_groups() -> None:
    """The calling thread's supplementary groups dropped, once (``open_as_here``)."""
    if not hasattr(_here, "refused") and os.geteuid() == 0 and _SYS_SETGROUPS is not None:
        grouped = _libc.syscall(_SYS_SETGROUPS, 0, None) == 0
        _here.own = (os.geteuid(), os.getegid())  # the thread's own, taken back after each
        _here.refused = None if grouped else OSError(ctypes.get_errno(), "setgroups")


def _open_here(source: Path, flags: int, reader: Identity) -> int:
    """Open ``source`` on this thread (``open_as_here`` first) with its filesystem uid and
    gid set to the reader's for the open alone, and the agent's again right after it (both
    per thread in Linux; its effective uid stays 0, so it may set them again). Nothing
    but the open runs meanwhile."""
    if _here.refused is not None:
        raise _here.refused
    uid, gid = _here.own
    _libc.setfsgid(reader.gid)
    _libc.setfsuid(reader.uid)
    try:
        # Each reads back the current value: the open runs as the reader or not at all.
        if _libc.setfsuid(-1) != reader.uid or _libc.setfsgid(-1) != reader.gid:
            raise PermissionError("setfsuid")
        return os.open(source, flags)
    finally:
        _libc.setfsuid(uid)
        _libc.setfsgid(gid)
        if _libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != gid:
            # Never the agent's rights again on this thread: every later open refused.
            _here.refused = PermissionError("cannot take the agent's filesystem uid back")


class _Opener:
    """One resident thread that runs work handed to it, opens as attempts among it: the
    thread of ``in_open_thread`` (an attempt's folders and sealed executable:
    ``Host.prepare``), or one of ``_Guard``'s, whose work is one open. Its supplementary
    groups are dropped once (``_drop_groups``); each open's filesystem uid and gid are the
    reader's (``_open_here``)."""

    def __init__(self, name: str = "open-as-attempt") -> None:
        self._requests: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], T]) -> concurrent.futures.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._requests.put((work, done))
        return done

    def stop(self) -> None:
        """The thread ends once the work before this is done."""
        self._requests.put(None)

    def _serve(self) -> None:
        _drop_groups()
        while (request := self._requests.get()) is not None:
            work, done = request
            try:
                done.set_result(work())
            except BaseException as exc:  # the asker has it (a NUL in a name too); it goes on
                done.set_exception(exc)


class _Guard:
    """Opens as attempts, and reads of what they opened, that may be given up on: each
    runs on a thread of its own (one kept spare, reused), waited for at most its time
    limit. One that does not answer by then (a FUSE mount whose server hangs: the open
    or read waits in the kernel, and past the first waiter of a folder not even SIGKILL
    ends it) fails its attempt (``ArtifactError``, retryable) and keeps its thread until
    it returns; an open or read of the same path meanwhile, or any while
    ``MAX_STUCK_OPENS`` hang, fails at once, so no more threads than that are ever left
    hanging. An open the waiter gave up on that returns later is closed; a read reads a
    copy of the descriptor that its thread closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: _Opener | None = None
        self._stuck: dict[str, tuple[_Opener, concurrent.futures.Future[Any]]] = {}

    def open(self, source: Path, flags: int, reader: Identity, limit_s: float) -> int:
        opener = self._take(source, limit_s)
        done = opener.submit(lambda: _open_here(source, flags, reader))
        return self._wait(source, opener, done, limit_s, _close_opened)

    def read(self, source: Path, fd: int, size: int, limit_s: float) -> bytes:
        """Up to ``size`` bytes read from ``fd`` (``source``, opened by ``open``)."""
        opener = self._take(source, limit_s)
        try:
            copy = os.dup(fd)
        except BaseException:
            self._give_back(opener)
            raise
        done = opener.submit(lambda: _read_copy(copy, size))
        return self._wait(source, opener, done, limit_s)

    def _take(self, source: Path, limit_s: float) -> _Opener:
        """A thread for work on ``source``, unless one of it hangs, or too many do."""
        with self._lock:
            for path, (_, waiting) in list(self._stuck.items()):
                if waiting.done():  # it returned at last (its thread ended with it)
                    del self._stuck[path]
            if str(source) in self._stuck or len(self._stuck) >= MAX_STUCK_OPENS:
                raise _unanswered(source, limit_s, still=True)
            opener, self._spare = self._spare or _Opener("open-with-limit"), None
        return opener

    def _wait(
        self,
        source: Path,
        opener: _Opener,
        done: concurrent.futures.Future[T],
        limit_s: float,
        late: Callable[[concurrent.futures.Future[T]], object] | None = None,
    ) -> T:
        """``done``'s result within ``limit_s``, else the thread is left to it (``late``:
        what to do with its result if it comes after all)."""
        try:
            value = done.result(timeout=limit_s)
        except concurrent.futures.TimeoutError:
            if late is not None:
                done.add_done_callback(late)
            opener.stop()  # its thread ends as soon as the work returns
            with self._lock:
                self._stuck[str(source)] = (opener, done)
            raise _unanswered(source, limit_s, still=False) from None
        except BaseException:
            self._give_back(opener)
            raise
        self._give_back(opener)
        return value

    def _give_back(self, opener: _Opener) -> None:
        with self._lock:
            if self._spare is None:
                self._spare = opener
                return
        opener.stop()  # another open ran meanwhile, on a thread of its own

    def hanging(self) -> list[str]:
        """The paths whose opens or reads did not answer and have not returned since."""
        with self._lock:
            return [path for path, (_, waiting) in self._stuck.items() if not waiting.done()]


def _read_copy(fd: int, size: int) -> bytes:
    """A read of ``fd``, a copy of the descriptor the caller reads, closed after it: the
    caller may close its own at once if it gives up on the read."""
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def _close_opened(done: concurrent.futures.Future[int]) -> None:
    if not done.cancelled() and done.exception() is None:
        os.close(done.result())


def _unanswered(source: Path, limit_s: float, *, still: bool) -> ArtifactError:
    why = " (an earlier open or read of it that did not answer still hangs)" if still else ""
    return ArtifactError(
        f"cannot read {source}: it did not answer within {limit_s:g} s{why}: its file "
        "system hangs (CAIRN_WORKER_SOURCE_TIMEOUT_S)",
        retryable=True,
    )


_guard = _Guard()


def hung_opens() -> int:
    """The agent's threads left to an open or read of a source that did not answer and
    has not returned since (a gauge of the worker's)."""
    return len(_guard.hanging())


async def in_open_thread(work: Callable[[], T]) -> T:
    """``work()`` on the thread that opens files as attempts (``_Opener``), off the event
    loop: work that opens a source as an attempt among other file work (``seal_local``,
    ``copy_local``) then hands off once, not twice."""
    return await asyncio.wrap_future(_opener().submit(work))


_openers: list[_Opener] = []
_openers_lock = threading.Lock()


def _opener() -> _Opener:
    with _openers_lock:
        if not _openers:
            _openers.append(_Opener())
        return _openers[0]


def _fingerprint(path: Path) -> tuple[int, int, int, int] | None:
    """What identifies the cached file as the one that was hashed."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _copy_same(source: Path, folder: Path, seen: tuple[int, int, int, int]) -> Path | None:
    """A private copy, by the kernel, of a cached file still the one that was hashed
    (``seen`` before and after the copy); None if it changed."""
    size = seen[2]
    fd, name = tempfile.mkstemp(dir=folder, prefix=".copy.")
    try:
        with source.open("rb") as src, os.fdopen(fd, "wb") as out:
            copied = 0
            while copied < size:
                step = os.copy_file_range(src.fileno(), out.fileno(), size - copied)
                if step == 0:
                    break
                copied += step
        if copied == size and _fingerprint(source) == seen:
            return Path(name)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    Path(name).unlink(missing_ok=True)
    return None


def _credentials_key(credentials: S3Credentials) -> str:
    """A digest of every part of the credentials: the secret key too, so knowing another
    team's key id (which is no secret) names no cache entry or client of theirs."""
    canonical = credentials.model_dump_json(exclude_none=True)
    return hashlib.sha256(f"cairn-s3-credentials\x00{canonical}".encode()).hexdigest()


def _digest(sha256: str) -> str:
    digest = sha256.lower()
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise ArtifactError("not a sha256 digest", retryable=False)
    return digest


def _scheme(uri: str) -> str:
    return uri.partition("://")[0].lower() if "://" in uri else ""


def _mismatch(uri: str) -> str:
    return f"sha256 mismatch: the content of {redact_url(uri)} does not have the declared digest"


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
