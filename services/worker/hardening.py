"""Process hardening for the agent, its sidecar and the attempts they start (Linux).

- ``non_dumpable``: no core dumps, and ``/proc/PID/{environ,mem,fd}`` and ptrace only for
  root, even for processes of the same uid.
- ``no_new_privs``: exec can never grant privileges again (setuid bits, file capabilities).
- ``scrub_environ``: a secret read from the environment is removed from ``os.environ`` and
  overwritten in the process's original environment block, which ``/proc/PID/environ``
  shows.
- ``read_token``: the token from ``CAIRN_TOKEN_FILE`` (owned by us, mode 0600 or less).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
from pathlib import Path

PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class HardeningError(Exception):
    """A hardening step could not be applied."""


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise HardeningError(f"prctl({option}) failed: {os.strerror(errno)}")


def non_dumpable() -> None:
    _prctl(PR_SET_DUMPABLE, 0)


def no_new_privs() -> None:
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def _environ_block() -> tuple[int, int]:
    """Where the kernel's copy of our environment lies (``env_start``, ``env_end``)."""
    stat_line = Path("/proc/self/stat").read_text()
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    # fields[0] is the state, field 3 of proc(5); env_start and env_end are 50 and 51.
    return int(fields[47]), int(fields[48])


def scrub_environ(*names: str) -> None:
    """Remove ``names`` from the environment, also from the block ``/proc/self/environ``
    reads, so a process that may read ours finds nothing there."""
    for name in names:
        os.environ.pop(name, None)
    try:
        block = Path("/proc/self/environ").read_bytes()
        start, end = _environ_block()
    except (OSError, ValueError, IndexError):
        return
    if end - start < len(block):
        return
    offset = 0
    for entry in block.split(b"\0"):
        key = entry.partition(b"=")[0].decode(errors="replace")
        if key in names:
            value_at = start + offset + len(key) + 1
            ctypes.memset(value_at, 0, len(entry) - len(key) - 1)
        offset += len(entry) + 1


def read_token(path: Path) -> str:
    """The token kept in ``path``, which only its owner (us) may read."""
    try:
        info = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        raise HardeningError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise HardeningError(
            f"the token file {path} must belong to this user and have mode 0600 "
            f"(it has owner {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
        )
    if not text:
        raise HardeningError(f"the token file {path} is empty")
    return text
