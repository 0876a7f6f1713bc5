"""Attempts' folders, made ahead: on this host's file systems a new inode (``mkdir``, a
created file) costs 0.3 ms of CPU where a ``rename`` or a ``link`` costs 0.02, and an
attempt had five of them.

A ready set is a home (with its ``tmp/``) and an executable folder, kept in the agent's
own pool folder (``RUN/.pool/agent-PID/``, 0700: no attempt reaches into it). An attempt
gets a set by two renames (``RUN/ID``, ``RUN/.exe/ID``) and a ``chown`` to its uid; its
executable is a hard link to a sealed verified copy (``artifacts.Sealed``).

A home and its ``tmp`` are never given to a second attempt: an attempt that owned them
may have handed an open descriptor or an inotify watch on them to a process of another
uid (over a unix socket), which would list the next attempt's files and see its activity
(read permission is checked at ``open`` only). So when an attempt ends, its home is
removed (``remove_tree``: by descriptor, links never followed, bounded) and a new set is
made in its place, both in the thread that takes the attempt back, off the critical path
of the next start; at most ``keep`` sets wait. A home that could not be removed in the
walk's bounds is set aside and retried by ``tidy``.

The executable folder never belonged to the attempt (0710, the agent's; its gid may only
pass through it to the executable, neither list it nor watch it), so it is used again:
only its one link is removed.

An attempt whose home is a tmpfs and whose spawn helper binds its sealed executable
(``bound``) has no executable folder at all: its executable's path is a placeholder,
``RUN/.bin/NAME`` (an empty file of the agent's, 0444, in a folder others may only pass
through, made once per name), on which the sealed copy is bound in the attempt's own
mount namespace only. Nothing is renamed, linked, owned or emptied per attempt.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import stat
import threading
from pathlib import Path

from services.worker import tmpfs
from services.worker.isolation import Folders, Identity, remove_tree

log = logging.getLogger("cairn.worker.workdirs")

#: placeholders remembered (``Workdirs.placeholder``; one per executable name)
MAX_PLACEHOLDERS = 4096
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Workdirs:
    """The ready sets of one agent under ``run_dir``; ``isolated``: attempts run as uids
    of their own (their folders are given to that uid; the executable folder to its gid)."""

    def __init__(self, run_dir: Path, isolated: bool, keep: int) -> None:
        self.run_dir = run_dir
        self.isolated = isolated
        self.keep = keep
        self.exe_root = run_dir / ".exe"
        #: placeholders of bound executables (``bound``), one per name
        self.bin_root = run_dir / ".bin"
        self._placeholders: dict[str, Path] = {}
        #: where an attempt's tmpfs is attached, in its own mount namespace only
        self.mount_point = run_dir / ".home"
        self._mount_tmp = self.mount_point / tmpfs.TMP
        self.pool = run_dir / ".pool" / f"agent-{os.getpid()}"
        self._homes: list[Path] = []
        self._exes: list[Path] = []
        self._leftover: list[Path] = []
        self._tidying: threading.Thread | None = None
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self.made = 0  # homes made when an attempt needed one (the slow path)
        self.ahead = 0  # homes made ahead when an attempt ended, off the critical path
        self.reused = 0  # executable folders used again

    def start(self, ahead: int = 0) -> None:
        """Make the pool folder (removing those of agents no longer alive) and ``ahead``
        ready sets."""
        self.exe_root.mkdir(mode=0o711, exist_ok=True)
        self.bin_root.mkdir(mode=0o711, exist_ok=True)
        self.mount_point.mkdir(mode=0o700, exist_ok=True)
        pools = self.run_dir / ".pool"
        pools.mkdir(mode=0o700, exist_ok=True)
        pools.chmod(0o700)
        for stale in pools.glob("agent-*"):
            pid = stale.name.removeprefix("agent-")
            if stale == self.pool or not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
                remove_tree(stale)
        self.pool.mkdir(mode=0o700)
        for _ in range(min(ahead, self.keep)):
            self._homes.append(self._new_home())
            self._exes.append(self._new_exe())

    def close(self) -> None:
        """Remove the ready sets and sealed copies (attempts still running keep theirs)."""
        with self._lock:
            self._homes, self._exes = [], []
        remove_tree(self.pool)

    def make(
        self,
        attempt_id: int,
        name: str,
        identity: Identity | None,
        quota_mb: int | None = None,
        bound: bool = False,
    ) -> Folders:
        """The attempt's folders, from a ready set (or new ones); with ``quota_mb`` (and
        an ``identity``), its home and tmp are a tmpfs of that size instead (``tmpfs``),
        attached on ``mount_point`` when it starts; with ``bound`` too, its executable is
        the placeholder of ``name`` (``placeholder``), no folder of its own, on which
        ``Folders.link_executable`` has the sealed copy bound when it starts."""
        if quota_mb is not None and identity is not None:
            if bound:
                mount = tmpfs.make(quota_mb, identity.uid, identity.gid)
                try:
                    executable = self.placeholder(name)
                except BaseException:
                    tmpfs.close(mount)
                    raise
                home, tmp = self.mount_point, self._mount_tmp
                return Folders(home, tmp, executable, identity, [], mount, quota_mb, True)
            return self._on_tmpfs(attempt_id, name, identity, quota_mb)
        home = self.run_dir / str(attempt_id)
        exe_dir = self.exe_root / str(attempt_id)
        for stale in (home, exe_dir):
            _remove_stale(stale)
        with self._lock:
            ready_home = self._homes.pop() if self._homes else None
            ready_exe = self._exes.pop() if self._exes else None
        if ready_home is None:
            self.made += 1
        if ready_exe is not None:
            self.reused += 1
        os.rename(ready_home or self._new_home(), home)
        os.rename(ready_exe or self._new_exe(), exe_dir)
        tmp = home / "tmp"
        if identity is not None:
            os.chown(home, identity.uid, identity.gid, follow_symlinks=False)
            os.chown(tmp, identity.uid, identity.gid, follow_symlinks=False)
            os.chown(exe_dir, os.geteuid(), identity.gid, follow_symlinks=False)
        return Folders(home, tmp, exe_dir / name, identity, [home, exe_dir])

    def placeholder(self, name: str) -> Path:
        """``bin_root``/``name``: an empty file of the agent's, 0444, made the first time
        (one an earlier agent left is taken if it is one; anything else there is replaced:
        only the agent writes in ``bin_root``). Raises ``OSError``."""
        known = self._placeholders.get(name)
        if known is not None:
            return known
        path = self.bin_root / name
        if not _placeholder(path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444))
            except FileExistsError:  # another agent sharing the run folder made it
                if not _placeholder(path):
                    raise
        if len(self._placeholders) >= MAX_PLACEHOLDERS:
            self._placeholders.clear()
        self._placeholders[name] = path
        return path

    def _on_tmpfs(self, attempt_id: int, name: str, identity: Identity, quota_mb: int) -> Folders:
        exe_dir = self.exe_root / str(attempt_id)
        _remove_stale(exe_dir)
        with self._lock:
            ready_exe = self._exes.pop() if self._exes else None
        if ready_exe is not None:
            self.reused += 1
        os.rename(ready_exe or self._new_exe(), exe_dir)
        try:
            os.chown(exe_dir, os.geteuid(), identity.gid, follow_symlinks=False)
            mount = tmpfs.make(quota_mb, identity.uid, identity.gid)
        except BaseException:
            remove_tree(exe_dir)
            raise
        home = self.mount_point
        return Folders(home, home / tmpfs.TMP, exe_dir / name, identity, [exe_dir], mount, quota_mb)

    def give_back(self, folders: Folders, reusable: bool) -> None:
        """Take the attempt's folders back: its home is removed (a tmpfs: let go) and a
        new set made ahead; its executable folder, emptied, goes back to the pool when
        ``reusable`` (no process of the attempt is left), else it is removed too."""
        unbind, folders.unbind = folders.unbind, None
        if unbind is not None:
            unbind()  # its bound copy, no longer named by a start to come
        if folders.quota_mb is not None:
            folders.unmount()
            if folders.made:  # none for a bound executable
                self._exe_back(folders.made[0], reusable)
            return
        home, exe_dir = folders.made
        try:
            if not remove_tree(home):
                self._set_aside(home)
            if len(self._homes) < self.keep:
                fresh = self._new_home()
                with self._lock:
                    self._homes.append(fresh)
                self.ahead += 1
        finally:
            self._exe_back(exe_dir, reusable)

    def _exe_back(self, exe_dir: Path, reusable: bool) -> None:
        if reusable and self._clear_exe(exe_dir) and len(self._exes) < self.keep:
            self._shelve(exe_dir, self._exes, "x")
        elif not remove_tree(exe_dir):
            self._set_aside(exe_dir)

    def tidy(self) -> None:
        """Retry removing what an earlier removal left (it gave up after its bounds), in
        a thread of its own: the caller (the agent's loop) is never held up by it."""
        with self._lock:
            if not self._leftover or (self._tidying is not None and self._tidying.is_alive()):
                return
            self._tidying = threading.Thread(target=self._retry, name="workdirs-tidy", daemon=True)
        self._tidying.start()

    def _retry(self) -> None:
        with self._lock:
            left, self._leftover = self._leftover, []
        for folder in left:
            if not remove_tree(folder):
                with self._lock:
                    self._leftover.append(folder)

    def _set_aside(self, folder: Path) -> None:
        """Out of the attempts' names (a retry of the attempt reuses its name)."""
        aside = self.pool / f"left{next(self._names)}"
        try:
            os.rename(folder, aside)
        except OSError as exc:
            log.warning("cannot set %s aside: %s", folder, exc)
            aside = folder
        with self._lock:
            self._leftover.append(aside)

    def _shelve(self, folder: Path, ready: list[Path], tag: str) -> None:
        spare = self.pool / f"{tag}{next(self._names)}"
        try:
            os.rename(folder, spare)
        except OSError as exc:
            log.warning("cannot shelve %s: %s", folder, exc)
            if not remove_tree(folder):
                self._set_aside(folder)
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
        exe.mkdir(mode=0o710 if self.isolated else 0o700)
        return exe

    def _clear_exe(self, exe_dir: Path) -> bool:
        """Unlink the executable (and any partial copy); the folder back to the agent."""
        try:
            fd = os.open(exe_dir, _OPEN_DIR)
        except OSError:
            return False
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o027:
                return False
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        return False
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=fd)
            if self.isolated:
                os.fchown(fd, os.geteuid(), os.getegid())
            return True
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.info("executable folder %s not reused: %s", exe_dir, exc)
            return False
        finally:
            os.close(fd)


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


def _placeholder(path: Path) -> bool:
    """Whether ``path`` is a placeholder: an empty regular file of ours nobody may write."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_uid == os.geteuid()
        and info.st_size == 0
        and not info.st_mode & 0o222
    )


def _remove_stale(folder: Path) -> None:
    """Remove what an earlier try of the same attempt left at ``folder``: mostly nothing,
    seen by one ``lstat`` (only the agent writes where attempts' folders are named, so
    nothing comes there between the look and the rename that follows)."""
    if os.path.lexists(folder):
        remove_tree(folder)


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
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        if info.st_size:  # an empty one (a task that wrote nothing) is left as it is
            os.ftruncate(fd, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
