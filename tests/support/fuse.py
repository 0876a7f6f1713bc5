"""A FUSE mount whose server never answers, for tests of what blocks on one (as root).

No FUSE library or ``fusermount`` is needed: root opens ``/dev/fuse`` and mounts it with
``mount(2)`` itself, then never reads the device, so every request (the INIT first, then
any LOOKUP) stays unanswered and an open of a path under the mount waits in the kernel.
Closing the device aborts the connection (every waiter gets ENOTCONN) and the mount is
detached, in ``unanswered_fuse``'s exit, so a failing test leaves nothing mounted."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_MNT_DETACH = 2


@contextlib.contextmanager
def unanswered_fuse(target: Path) -> Iterator[Path]:
    """``target`` (a folder, made if missing) with a FUSE file system mounted on it whose
    server never answers; checked to block an open under it before it is handed over."""
    target.mkdir(parents=True, exist_ok=True)
    device = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        data = f"fd={device},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if _libc.mount(b"cairn-test-fuse", str(target).encode(), b"fuse", 0, data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount fuse on {target}: {os.strerror(err)}")
        try:
            if not blocks(target / "probe"):
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
