"""Attempts' folders, made ahead and used again: on this host's file systems a new inode
(``mkdir``, a created file) costs 0.3 ms of CPU where a ``rename`` or a ``link`` costs
0.02, and an attempt had five of them.

A ready set is a home (with its ``tmp/``) and an executable folder, kept in the agent's
own pool folder (``RUN/.pool/agent-PID/``, 0700: no attempt reaches into it). An attempt
gets a set by two renames (``RUN/ID``, ``RUN/.exe/ID``) and a ``chown`` to its uid; its
executable is a hard link to a sealed verified copy (``artifacts.Sealed``). When it ends,
and only once its cgroup was seen empty (no process of it can write any more), the set is
taken back from its uid and checked before the next attempt may have it:

- first the home and its ``tmp`` go back to the agent, mode 0700 (by descriptor, opened
  without following links: the attempt owned them and may have swapped ``tmp`` for a link);
- its ACLs and ``user.*`` attributes are removed; its inode flags and extended attributes
  (``FS_IOC_FSGETXATTR``: project, casefold, encryption...) must be those of a new folder;
- everything in it is removed (links are removed, never followed: fifos, sockets, deep
  trees), and it must then hold ``tmp`` alone, and ``tmp`` nothing, and neither may have
  grown past ``MAX_DIR_BYTES`` (a folder that once held many names stays large).

A set that fails any check is removed (``remove_tree``) instead, and a new one made. At
most ``keep`` sets wait. The executable folder never belonged to the attempt (0750, the
agent's, its gid may only read), so only its one link is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import shutil
import stat
import struct
import threading
from pathlib import Path

from services.worker.isolation import Folders, Identity, remove_tree

log = logging.getLogger("cairn.worker.workdirs")

#: a folder that once held more names than this stays large (ext4 never shrinks one)
MAX_DIR_BYTES = 64 * 1024
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_FSGETXATTR = 0x801C581F
_FSXATTR = struct.Struct("=IIII12x")  # xflags, extsize, nextents, projid
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: attributes the owner of a folder may set without privileges, removed on return
_OWNER_XATTRS = ("user.", "system.posix_acl_")


def _traits(fd: int) -> tuple[object, ...]:
    """What of a folder's inode an owner might change and a reuse must not inherit."""
    flags: object = None
    with contextlib.suppress(OSError):
        flags = fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(8))[:4]
    fsx: object = None
    with contextlib.suppress(OSError):
        xflags, _, _, projid = _FSXATTR.unpack(fcntl.ioctl(fd, FS_IOC_FSGETXATTR, bytes(28)))
        fsx = (xflags, projid)
    names: tuple[str, ...] = ()
    with contextlib.suppress(OSError):
        names = tuple(sorted(os.listxattr(fd)))
    return flags, fsx, names


class Workdirs:
    """The ready sets of one agent under ``run_dir``; ``isolated``: attempts run as uids
    of their own (their folders are given to that uid; the executable folder to its gid)."""

    def __init__(self, run_dir: Path, isolated: bool, keep: int) -> None:
        self.run_dir = run_dir
        self.isolated = isolated
        self.keep = keep
        self.exe_root = run_dir / ".exe"
        self.pool = run_dir / ".pool" / f"agent-{os.getpid()}"
        self._homes: list[Path] = []
        self._exes: list[Path] = []
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self._fresh: tuple[object, ...] | None = None
        self.made = 0  # sets made new (the slow path), for tests and benchmarks
        self.reused = 0

    def start(self, ahead: int = 0) -> None:
        """Make the pool folder (removing those of agents no longer alive) and ``ahead``
        ready sets."""
        self.exe_root.mkdir(mode=0o711, exist_ok=True)
        pools = self.run_dir / ".pool"
        pools.mkdir(mode=0o700, exist_ok=True)
        pools.chmod(0o700)
        for stale in pools.glob("agent-*"):
            pid = stale.name.removeprefix("agent-")
            if stale == self.pool or not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
                remove_tree(stale)
        self.pool.mkdir(mode=0o700)
        probe = self._new_home()
        fd = os.open(probe, _OPEN_DIR)
        try:
            self._fresh = _traits(fd)
        finally:
            os.close(fd)
        self._homes.append(probe)
        for _ in range(min(ahead, self.keep) - 1):
            self._homes.append(self._new_home())
        for _ in range(min(ahead, self.keep)):
            self._exes.append(self._new_exe())

    def close(self) -> None:
        """Remove the ready sets and sealed copies (attempts still running keep theirs)."""
        with self._lock:
            self._homes, self._exes = [], []
        remove_tree(self.pool)

    def make(self, attempt_id: int, name: str, identity: Identity | None) -> Folders:
        """The attempt's folders, from a ready set (or new ones)."""
        home = self.run_dir / str(attempt_id)
        exe_dir = self.exe_root / str(attempt_id)
        for stale in (home, exe_dir):
            remove_tree(stale)  # left by an earlier try of the same attempt
        with self._lock:
            ready_home = self._homes.pop() if self._homes else None
            ready_exe = self._exes.pop() if self._exes else None
        if ready_home is None or ready_exe is None:
            self.made += 1
        else:
            self.reused += 1
        os.rename(ready_home or self._new_home(), home)
        os.rename(ready_exe or self._new_exe(), exe_dir)
        tmp = home / "tmp"
        if identity is not None:
            os.chown(home, identity.uid, identity.gid, follow_symlinks=False)
            os.chown(tmp, identity.uid, identity.gid, follow_symlinks=False)
            os.chown(exe_dir, os.geteuid(), identity.gid, follow_symlinks=False)
        return Folders(home, tmp, exe_dir / name, identity, [home, exe_dir])

    def give_back(self, folders: Folders, reusable: bool) -> None:
        """Take the attempt's folders back: checked and emptied into the pool when
        ``reusable`` (no process of the attempt is left) and they pass, else removed."""
        home, exe_dir = folders.made
        if reusable and len(self._homes) < self.keep and self._scrub(home):
            self._shelve(home, self._homes, "h")
        else:
            remove_tree(home)
        if self._clear_exe(exe_dir) and len(self._exes) < self.keep:
            self._shelve(exe_dir, self._exes, "x")
        else:
            remove_tree(exe_dir)

    def _shelve(self, folder: Path, ready: list[Path], tag: str) -> None:
        spare = self.pool / f"{tag}{next(self._names)}"
        try:
            os.rename(folder, spare)
        except OSError as exc:
            log.warning("cannot shelve %s: %s", folder, exc)
            remove_tree(folder)
            return
        with self._lock:
            ready.append(spare)

    def _new_home(self) -> Path:
        home = self.pool / f"h{next(self._names)}"
        home.mkdir(mode=0o700)
        (home / "tmp").mkdir(mode=0o700)
        return home

    def _new_exe(self) -> Path:
        exe = self.pool / f"x{next(self._names)}"
        exe.mkdir(mode=0o750 if self.isolated else 0o700)
        return exe

    def _clear_exe(self, exe_dir: Path) -> bool:
        """Unlink the executable (and any partial copy); the folder back to the agent."""
        try:
            fd = os.open(exe_dir, _OPEN_DIR)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                return False
            for entry in os.listdir(fd):
                os.unlink(entry, dir_fd=fd)
            if self.isolated:
                os.fchown(fd, os.geteuid(), os.getegid())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _scrub(self, home: Path) -> bool:
        """Whether the home (and its tmp) is back to the agent, plain and empty."""
        try:
            fd = os.open(home, _OPEN_DIR)
        except OSError:
            return False
        try:
            if not self._reclaim(fd) or not _empty_but(fd, "tmp"):
                return False
            try:
                tmp = os.open("tmp", _OPEN_DIR, dir_fd=fd)
            except OSError:
                return False
            try:
                return self._reclaim(tmp) and _empty_but(tmp, None)
            finally:
                os.close(tmp)
        except (OSError, RecursionError) as exc:
            log.info("attempt folder %s not reused: %s", home, exc)
            return False
        finally:
            os.close(fd)

    def _reclaim(self, fd: int) -> bool:
        """The folder back to the agent, 0700, without what its owner may have set."""
        os.fchown(fd, os.geteuid(), os.getegid())
        os.fchmod(fd, 0o700)
        for name in os.listxattr(fd):
            if name.startswith(_OWNER_XATTRS):
                os.removexattr(fd, name)
        info = os.fstat(fd)
        return (
            stat.S_ISDIR(info.st_mode)
            and info.st_size <= MAX_DIR_BYTES
            and _traits(fd) == self._fresh
        )


def _empty_but(fd: int, keep: str | None) -> bool:
    """Remove every entry of the folder but ``keep`` (a folder, not a link); links are
    removed, never followed. True when only ``keep`` is left."""
    kept = False
    for entry in os.scandir(fd):
        if entry.name == keep and entry.is_dir(follow_symlinks=False):
            kept = True
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.name, dir_fd=fd)
        else:
            try:
                os.unlink(entry.name, dir_fd=fd)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
    left = os.listdir(fd)
    return left == ([keep] if keep is not None and kept else [])


class SpareLogs:
    """Attempts' log files used again (``folder/.spare``, the agent's): a log is the one
    file an attempt still needed made, and on ext4 a file made where many were just
    removed costs up to a millisecond (the allocator skips recently freed inodes).

    A log goes back to the spares when its attempt is over, and out again, emptied, only
    if nobody else holds it open: an attempt may have handed its output descriptor to a
    process of another attempt, which must not write into the next attempt's log. The
    kernel grants a write lease (``F_SETLEASE``) only to a file that no other open file
    description refers to (those in flight in a socket too); it is taken and dropped at
    once, as that proof. A log that fails it is removed instead."""

    def __init__(self, folder: Path, keep: int) -> None:
        self.spare = folder / ".spare"
        self.keep = keep
        self._ready: list[Path] = []
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self.reused = 0

    def start(self) -> None:
        remove_tree(self.spare)
        self.spare.mkdir(mode=0o700)

    def close(self) -> None:
        with self._lock:
            self._ready = []
        remove_tree(self.spare)

    def take(self, path: Path) -> None:
        """Put an emptied spare log at ``path`` (nothing if none is free, or a file is
        already there: the attempt's start makes or appends to it)."""
        if os.path.lexists(path):
            return
        while True:
            with self._lock:
                spare = self._ready.pop() if self._ready else None
            if spare is None:
                return
            if _emptied_alone(spare):
                os.rename(spare, path)
                self.reused += 1
                return
            spare.unlink(missing_ok=True)

    def give_back(self, path: Path) -> None:
        if len(self._ready) >= self.keep:
            path.unlink(missing_ok=True)
            return
        spare = self.spare / str(next(self._names))
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            return
        with self._lock:
            self._ready.append(spare)


def _emptied_alone(path: Path) -> bool:
    """Whether no other open file refers to the log (a write lease is granted), which
    is then emptied."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.ftruncate(fd, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
