"""An attempt's files on a tmpfs of its own: its home (working folder) and its /tmp, at
most its disk quota, gone with it.

The agent makes the tmpfs detached (``fsopen``, ``fsconfig``, ``fsmount``: no path on
the host ever names it) and keeps the descriptor; the spawn helper attaches it on the
attempt's home path inside the attempt's own mount namespace (``move_mount``), so no
other process sees it. The agent reads the attempt's outputs and progress files through
its descriptor (``/proc/self/fd/N``), also after the attempt's namespace is gone; closing
the descriptor frees the pages, which were charged to the memory cgroup of the process
that wrote them (the attempt's). Nothing is made on disk, nothing walked and removed.

A write past the quota fails with ``ENOSPC`` in the task; an attempt that failed with its
tmpfs full ends ``disk_exceeded`` (``full``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# The same numbers on every architecture (the new mount API came after their split).
_MOVE_MOUNT, _FSOPEN, _FSCONFIG, _FSMOUNT = 429, 430, 431, 432
_FSOPEN_CLOEXEC = _FSMOUNT_CLOEXEC = 0x1
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x2, 0x4
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
#: files per MiB of quota (each inode costs kernel memory too), within these bounds
INODES_PER_MB = 256
MIN_INODES, MAX_INODES = 1024, 1 << 20
#: free pages under which a full tmpfs is assumed (a write that did not fit leaves less
#: than one write's worth)
FULL_BELOW_PAGES = 16
#: the tmp folder inside it, bound on /tmp and /var/tmp
TMP = "tmp"
#: a tmpfs holding more than this is let go in a thread, not on the agent's event loop
FREE_INLINE_MB = 8


def _call(number: int, *args: object) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return int(result)


def make(quota_mb: int, uid: int, gid: int) -> int:
    """A detached tmpfs of ``quota_mb`` MiB (its root 0700 ``uid``:``gid``, with a
    ``tmp`` folder of the same), nosuid and nodev; its descriptor. Raises ``OSError``."""
    fs = _call(_FSOPEN, b"tmpfs", _FSOPEN_CLOEXEC)
    try:
        inodes = min(MAX_INODES, max(MIN_INODES, quota_mb * INODES_PER_MB))
        options = {
            b"size": f"{quota_mb}m",
            b"nr_inodes": str(inodes),
            b"mode": "0700",
            b"uid": str(uid),
            b"gid": str(gid),
        }
        for key, value in options.items():
            _call(_FSCONFIG, fs, _FSCONFIG_SET_STRING, key, value.encode(), 0)
        _call(_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0)
        mount = _call(_FSMOUNT, fs, _FSMOUNT_CLOEXEC, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
    finally:
        os.close(fs)
    try:
        os.mkdir(TMP, 0o700, dir_fd=mount)
        os.chown(TMP, uid, gid, dir_fd=mount, follow_symlinks=False)
    except BaseException:
        os.close(mount)
        raise
    return mount


def attach(mount: int, target: str) -> None:
    """Attach the detached tmpfs on ``target`` (in the caller's mount namespace: the
    forked child's, when the agent starts an attempt without the helper)."""
    _call(_MOVE_MOUNT, mount, b"", -100, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH)


def view(mount: int) -> Path:
    """Where the agent reads the attempt's files: through its descriptor."""
    return Path(f"/proc/self/fd/{mount}")


def full(mount: int) -> bool:
    """Whether the tmpfs is full (in space or in files)."""
    try:
        info = os.fstatvfs(mount)
    except OSError:
        return False
    return info.f_bavail < FULL_BELOW_PAGES or info.f_favail == 0


def used_mb(mount: int) -> float:
    """What its files hold, in MB (0 if it cannot be read)."""
    try:
        info = os.fstatvfs(mount)
    except OSError:
        return 0.0
    return (info.f_blocks - info.f_bfree) * info.f_frsize / 2**20


def close(mount: int | None) -> None:
    if mount is not None:
        with contextlib.suppress(OSError):
            os.close(mount)


def works() -> bool:
    """Whether this host lets the agent make one (root, a kernel with the mount API)."""
    try:
        close(make(1, os.geteuid(), os.getegid()))
    except OSError:
        return False
    return True
