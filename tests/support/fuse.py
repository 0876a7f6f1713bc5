"""A FUSE mount whose server never answers, for tests of what blocks on one (as root).

No FUSE library or ``fusermount`` is needed: root opens ``/dev/fuse`` and mounts it with
``mount(2)`` itself, then never reads the device, so every request (the INIT first, then
any LOOKUP) stays unanswered and an open of a path under the mount waits in the kernel.
Closing the device aborts the connection (every waiter gets ENOTCONN) and the mount is
detached, in ``unanswered_fuse``'s exit, so a failing test leaves nothing mounted.
``unread_fuse`` answers every request but a read: its one file opens, and hangs on a
read; or, while the test holds its opens, its opens wait, and are answered once let go."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_MNT_DETACH = 2


@contextlib.contextmanager
def unanswered_fuse(target: Path, probe: bool = True) -> Iterator[Path]:
    """``target`` (a folder, made if missing) with a FUSE file system mounted on it whose
    server never answers; checked to block an open under it before it is handed over.
    That probe's open stays waiting, holding the root's lock, so every later open under
    the mount waits on that lock, past SIGKILL. ``probe=False``: none is left waiting, so
    the first open waits (for the INIT) holding the lock, and SIGKILL ends it, as on a
    hard NFS mount whose server is gone."""
    target.mkdir(parents=True, exist_ok=True)
    device = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        data = f"fd={device},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if _libc.mount(b"cairn-test-fuse", str(target).encode(), b"fuse", 0, data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount fuse on {target}: {os.strerror(err)}")
        try:
            if probe and not blocks(target / "probe"):
                raise AssertionError(f"an open under the FUSE mount on {target} did not block")
            yield target
        finally:
            os.close(device)  # the connection aborted: any waiter is let go
            device = -1
            _libc.umount2(str(target).encode(), _MNT_DETACH)
    finally:
        if device >= 0:
            os.close(device)


def blocks(path: Path, wait_s: float = 0.3) -> bool:
    """Whether an open of ``path`` is still waiting after ``wait_s`` (the thread that
    tried is let go when the connection is aborted)."""
    done = threading.Event()

    def attempt() -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_RDONLY))
        done.set()

    threading.Thread(target=attempt, daemon=True, name="fuse-probe").start()
    return not done.wait(wait_s)


# The FUSE protocol as far as ``unread_fuse`` needs it (linux/fuse.h): opcodes, the
# headers, and the replies it makes.
_LOOKUP, _FORGET, _GETATTR, _OPEN, _READ, _STATFS, _RELEASE, _FLUSH, _INIT = (
    1,
    2,
    3,
    14,
    15,
    17,
    18,
    25,
    26,
)
#: ``statfs``'s f_type of every FUSE mount (the kernel's FUSE_SUPER_MAGIC)
FUSE_TYPE = 0x65735546
_UNANSWERED_OPS = frozenset({_FORGET, _READ, 36, 42})  # FORGET, READ, INTERRUPT, BATCH_FORGET
_IN = struct.Struct("<IIQQIIII")
_OUT = struct.Struct("<IiQ")
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_MAX_WRITE = 1 << 17
_ROOT, _FILE = 1, 2


@contextlib.contextmanager
def unread_fuse(
    target: Path, name: str, size: int, held: threading.Event | None = None
) -> Iterator[Path]:
    """``target`` with a FUSE file system on it whose server answers everything but a
    read: the root folder holds the file ``name`` of ``size`` bytes (mode 0755, owned by
    root), which opens at once (checked before it is handed over) and whose every read
    waits in the kernel (until the exit, which aborts the connection). Its path.
    ``held``: while it is set, each open waits unanswered; once it is cleared, they are
    answered (within 50 ms)."""
    target.mkdir(parents=True, exist_ok=True)
    device = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    stop = threading.Event()
    server = threading.Thread(
        target=_serve,
        args=(device, name.encode(), size, stop, held),
        daemon=True,
        name="fuse-unread",
    )
    try:
        data = f"fd={device},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if _libc.mount(b"cairn-test-fuse", str(target).encode(), b"fuse", 0, data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount fuse on {target}: {os.strerror(err)}")
        server.start()
        try:
            # Else a test of a read that hangs would pass on an open that hangs.
            if blocks(target / name, 5.0):
                raise AssertionError(f"an open of {name} under the FUSE mount did not answer")
            yield target / name
        finally:
            stop.set()
            server.join(5)
            os.close(device)  # the connection aborted: the reads waiting are let go
            device = -1
            _libc.umount2(str(target).encode(), _MNT_DETACH)
    finally:
        if device >= 0:
            os.close(device)


def _serve(
    device: int, name: bytes, size: int, stop: threading.Event, held: threading.Event | None
) -> None:
    waiting: list[bytes] = []  # the opens held
    while not stop.is_set():
        if waiting and not (held and held.is_set()):
            for request in waiting:
                _answer(device, request, name, size)
            waiting.clear()
        if not select.select([device], [], [], 0.05)[0]:
            continue
        try:
            request = os.read(device, _MAX_WRITE + 4096)
        except OSError:
            return  # ENODEV: unmounted
        opcode = _IN.unpack_from(request)[1]
        if opcode == _OPEN and held is not None and held.is_set():
            waiting.append(request)
        elif opcode not in _UNANSWERED_OPS:
            _answer(device, request, name, size)


def _answer(device: int, request: bytes, name: bytes, size: int) -> None:
    _, opcode, unique, node, *_ = _IN.unpack_from(request)
    error, reply = _reply(opcode, node, request[_IN.size :], name, size)
    with contextlib.suppress(OSError):  # ENOENT: the request was interrupted
        os.write(device, _OUT.pack(_OUT.size + len(reply), -error, unique) + reply)


def _reply(opcode: int, node: int, body: bytes, name: bytes, size: int) -> tuple[int, bytes]:
    """(errno, the reply's body) to one request."""
    if opcode == _INIT:
        max_readahead = struct.unpack_from("<I", body, 8)[0]
        init = struct.pack("<IIIIHHIIHHI", 7, 31, max_readahead, 0, 16, 12, _MAX_WRITE, 1, 32, 0, 0)
        return 0, init + bytes(28)
    if opcode == _LOOKUP:
        if node != _ROOT or body.rstrip(b"\0") != name:
            return errno.ENOENT, b""
        return 0, struct.pack("<QQQQII", _FILE, 0, 3600, 3600, 0, 0) + _attr(_FILE, size)
    if opcode == _GETATTR:
        return 0, struct.pack("<QII", 3600, 0, 0) + _attr(node, size)
    if opcode == _OPEN:
        return 0, struct.pack("<QII", 1, 0, 0)
    if opcode == _STATFS:  # blocks, free, available, files, free files; sizes; spare
        return 0, struct.pack("<QQQQQIIII", 1, 0, 0, 2, 0, 4096, 255, 4096, 0) + bytes(24)
    if opcode in (_RELEASE, _FLUSH):
        return 0, b""
    return errno.ENOSYS, b""


def _attr(node: int, size: int) -> bytes:
    mode = stat.S_IFDIR | 0o755 if node == _ROOT else stat.S_IFREG | 0o755
    length = 0 if node == _ROOT else size
    return _ATTR.pack(
        node, length, (length + 511) // 512, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0
    )
