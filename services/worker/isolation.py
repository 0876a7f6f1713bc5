"""Who an attempt runs as and what it can reach.

An agent running as root gives each attempt a uid (and a gid of the same number) of its
own from ``CAIRN_WORKER_UIDS``, held by a lock file per uid (``CAIRN_WORKER_UID_LOCKS``)
so that agents on one host never share one. The attempt gets no supplementary groups, no
capabilities (all uids change from 0, which clears them), ``no_new_privs``, a 0700 folder
of its own as home and working directory, and a private ``/tmp`` (a mount namespace with
its own folder bound on ``/tmp`` and ``/var/tmp`` and a fresh ``/dev/shm``, where the host
allows it; otherwise ``TMPDIR``). Its executable is a verified copy that belongs to root
and that nobody else may change, in a folder only the attempt's gid may enter.

Layout under the run folder (``CAIRN_WORKER_RUN_DIR``; every folder above it must be
searchable by others, since the attempts' uids pass through it)::

    RUN/            0711 agent         others may pass, not list
    RUN/ID/         0700 uid:gid       the attempt's home and working directory
    RUN/ID/tmp/     0700 uid:gid       its /tmp
    RUN/.exe/       0711 agent
    RUN/.exe/ID/    0750 agent:gid     its executable folder
    RUN/.exe/ID/X   0555 agent         a hard link to the sealed verified copy
    RUN/.pool/      0700 agent         ready folders and sealed copies (``workdirs``)

An agent not running as root (no isolation) gives its attempts a private copy of the
executable instead (0500, ``RUN/.exe/ID`` 0700).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import random
import resource
import shutil
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.worker import hardening

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(Exception):
    """The attempt cannot be isolated as configured (no uid free, a folder refused)."""


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int


@dataclass(frozen=True)
class Sandbox:
    """What the child applies to itself between fork and exec, as root, in this order:
    join the cgroups, enter a private mount namespace, set rlimits, drop to the uid.
    ``preexec`` does it in a fork of the agent; the resident spawn helper (``spawner``)
    applies the same fields itself (``executor._launch``), born in its cgroup already."""

    identity: Identity | None = None
    cgroup_procs: tuple[str, ...] = ()
    private_tmp: Path | None = None
    tmp_targets: tuple[str, ...] = ()
    shm: bool = False
    rlimits: tuple[tuple[int, int], ...] = ()

    def preexec(self) -> Callable[[], None]:
        def apply() -> None:
            pid = str(os.getpid())
            for procs in self.cgroup_procs:
                with open(procs, "w") as handle:
                    handle.write(pid)
            if self.private_tmp is not None:
                _private_mounts(self.private_tmp, self.tmp_targets, self.shm)
            for which, value in self.rlimits:
                resource.setrlimit(which, (value, value))
            if self.identity is not None:
                uid, gid = self.identity.uid, self.identity.gid
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            hardening.no_new_privs()
            os.umask(0o077)

        return apply


def _mount(
    source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None
) -> None:
    if _libc.mount(source, target, fstype, ctypes.c_ulong(flags), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target.decode()}: {os.strerror(errno)}")


def _private_mounts(tmp: Path, targets: tuple[str, ...], shm: bool) -> None:
    if _libc.unshare(CLONE_NEWNS) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare: {os.strerror(errno)}")
    _mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    for target in targets:
        _mount(str(tmp).encode(), target.encode(), None, MS_BIND, None)
    if shm:
        _mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=1777,size=64m")


def mount_namespaces_work() -> bool:
    """Whether this host lets the agent give an attempt its own mount namespace."""

    def probe() -> None:
        if _libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        _mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)

    try:
        subprocess.run(["/bin/true"], preexec_fn=probe, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def searchable_by_others(folder: Path) -> Path | None:
    """The first folder from ``/`` down to ``folder`` that others may not pass, if any."""
    for part in [*reversed(folder.parents), folder]:
        try:
            mode = part.stat().st_mode
        except FileNotFoundError:
            return None
        if not mode & stat.S_IXOTH:
            return part
    return None


class UidPool:
    """The uids this agent may hand out, each held by a lock file while in use."""

    def __init__(self, uids: range, lock_dir: Path) -> None:
        self.uids = uids
        self.lock_dir = lock_dir
        self._held: dict[int, int] = {}
        self._next = random.randrange(len(uids))  # noqa: S311 - spreading, not secrecy
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = lock_dir.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise IsolationError(
                f"{lock_dir} must be a folder of this user that others cannot write"
            )

    def take(self) -> Identity:
        """A uid no attempt on this host holds; the least recently handed out first."""
        for _ in range(len(self.uids)):
            uid = self.uids[self._next]
            self._next = (self._next + 1) % len(self.uids)
            if uid in self._held:
                continue
            fd = os.open(
                self.lock_dir / str(uid),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._held[uid] = fd
            return Identity(uid, uid)
        raise IsolationError(f"every uid of {self.uids.start}-{self.uids.stop - 1} is in use")

    def give_back(self, identity: Identity) -> None:
        fd = self._held.pop(identity.uid, None)
        if fd is not None:
            os.close(fd)


def kill_every_process_of(identity: Identity) -> None:
    """SIGKILL whatever still runs as the attempt's uid (``kill -1`` sent as that uid)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            ["/bin/sh", "-c", "kill -9 -1 2>/dev/null; true"],
            user=identity.uid,
            group=identity.gid,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin"},
            timeout=10,
            check=False,
        )


@dataclass
class Folders:
    """The attempt's folders and executable, made for ``identity`` (None: the agent's)."""

    home: Path
    tmp: Path
    executable: Path
    identity: Identity | None = None
    made: list[Path] = field(default_factory=list)

    @classmethod
    def make(cls, run_dir: Path, attempt_id: int, name: str, identity: Identity | None) -> Folders:
        home = run_dir / str(attempt_id)
        exe_dir = run_dir / ".exe"
        exe_dir.mkdir(mode=0o711, exist_ok=True)
        for stale in (home, exe_dir / str(attempt_id)):
            remove_tree(stale)
        home.mkdir(mode=0o700)
        tmp = home / "tmp"
        tmp.mkdir(mode=0o700)
        if identity is not None:
            os.chown(home, identity.uid, identity.gid)
            os.chown(tmp, identity.uid, identity.gid)
        (exe_dir / str(attempt_id)).mkdir(mode=0o711)
        executable = exe_dir / str(attempt_id) / name
        return cls(home, tmp, executable, identity, [home, exe_dir / str(attempt_id)])

    def seal_executable(self, written: Path) -> None:
        """Put the verified copy in place: the agent's, read+exec for the attempt only."""
        if self.identity is not None:
            os.chown(written, os.geteuid(), self.identity.gid)
            written.chmod(0o550)
        else:
            written.chmod(0o500)
        os.replace(written, self.executable)

    def link_executable(self, sealed: Path) -> None:
        """The executable as a hard link to a sealed verified copy (``artifacts.Sealed``:
        the agent's, 0555), in a folder only the attempt's gid may search."""
        os.link(sealed, self.executable)

    def remove(self) -> None:
        for folder in self.made:
            remove_tree(folder)


def remove_tree(path: Path) -> None:
    """Remove a folder an attempt wrote into; symlinks in it are removed, never followed."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    _make_removable(path)
    shutil.rmtree(path, ignore_errors=True)


def _make_removable(path: Path) -> None:
    # An attempt may leave folders of mode 0 behind; as root that does not matter, but a
    # non-root agent (isolation none) needs the write bit to empty them.
    if os.geteuid() == 0:
        return
    for root, dirs, _ in os.walk(path, followlinks=False):
        for name in dirs:
            folder = os.path.join(root, name)
            if not os.path.islink(folder):
                with contextlib.suppress(OSError):
                    os.chmod(folder, 0o700)
