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
    RUN/.exe/ID/    0710 agent:gid     its executable folder (pass, not list)
    RUN/.exe/ID/X   0555 agent         a hard link to the sealed verified copy
    RUN/.pool/      0700 agent         ready folders and sealed copies (``workdirs``)

An agent not running as root (no isolation) gives its attempts a private copy of the
executable instead (0500, ``RUN/.exe/ID`` 0700).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import platform
import random
import re
import resource
import socket
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.worker import hardening, tmpfs

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger("cairn.worker.isolation")


class IsolationError(Exception):
    """The attempt cannot be isolated as configured (no uid free, a folder refused)."""


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int


@dataclass(frozen=True)
class Sandbox:
    """What the child applies to itself between fork and exec, as root, in this order:
    join the cgroups, enter a private mount namespace, a network namespace of its own
    (egress ``none``: loopback only), an IPC namespace of its own, set rlimits, drop to
    the uid.
    ``preexec`` does it in a fork of the agent; the resident spawn helper (``spawner``)
    applies the same fields itself (``executor._launch``), born in its cgroup already."""

    identity: Identity | None = None
    cgroup_procs: tuple[str, ...] = ()
    private_tmp: Path | None = None
    tmp_targets: tuple[str, ...] = ()
    shm: bool = False
    rlimits: tuple[tuple[int, int], ...] = ()
    netns: bool = False
    #: an IPC namespace of its own: System V shared memory, message queues and
    #: semaphores it makes are seen by no other attempt and end with its last process
    #: (in the host's, they outlived it, their pages held, and the next attempt given
    #: its uid could attach them)
    ipc: bool = False
    #: the attempt's tmpfs, attached on ``home`` in its mount namespace
    mount: int | None = None
    home: str | None = None
    #: (the sealed copy, the executable's path): bound there in its mount namespace
    bind: tuple[str, str] | None = None
    #: (a ``file://`` source, its stamp): checked by the spawn helper's checker first
    #: (``Folders.source_check``); a fork of the agent never starts such an attempt
    source_check: tuple[str, tuple[int, int, int, int, int]] | None = None
    #: how long that check may take (``WorkerSettings.worker_source_timeout_s``)
    source_timeout_s: float | None = None
    #: enter the network namespace of this process (an exec probe of an attempt with
    #: egress ``none``: docs/services.md) instead of the host's
    join_netns: int | None = None
    #: enter the mount namespace of this process (an exec probe: it sees the attempt's
    #: own home and /tmp, its tmpfs included) instead of making private mounts
    join_mounts: int | None = None

    def preexec(self) -> Callable[[], None]:
        def apply() -> None:
            pid = str(os.getpid())
            for procs in self.cgroup_procs:
                with open(procs, "w") as handle:
                    handle.write(pid)
            if self.join_mounts is not None:
                here = os.getcwd()
                _join(self.join_mounts, "mnt", CLONE_NEWNS)  # resets the cwd to its root
                os.chdir(self.home if self.mount is not None and self.home else here)
            elif self.private_tmp is not None:
                home = self.home if self.mount is not None else None
                _private_mounts(
                    self.private_tmp, self.tmp_targets, self.shm, self.mount, home, self.bind
                )
                if home is not None:
                    os.chdir(home)  # Popen entered the folder under the mount
            self._namespaces()
            for which, value in self.rlimits:
                resource.setrlimit(which, (value, value))
            if self.identity is not None:
                uid, gid = self.identity.uid, self.identity.gid
                keyrings = join_keyring()
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                if keyrings:
                    empty_keyrings()
            hardening.no_new_privs()
            os.umask(0o077)

        return apply

    def _namespaces(self) -> None:
        """The network and IPC namespaces ``preexec`` enters (after the mounts)."""
        if self.netns:
            own_network()
        if self.ipc:
            _unshare(CLONE_NEWIPC)
        if self.join_netns is not None:
            join_network(self.join_netns)


def _mount(
    source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None
) -> None:
    if _libc.mount(source, target, fstype, ctypes.c_ulong(flags), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target.decode()}: {os.strerror(errno)}")


def _private_mounts(
    tmp: Path,
    targets: tuple[str, ...],
    shm: bool,
    mount: int | None,
    home: str | None,
    bind: tuple[str, str] | None = None,
) -> None:
    _unshare(CLONE_NEWNS)
    _mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    if mount is not None and home is not None:
        tmpfs.attach(mount, home)
    if bind is not None:
        _mount(bind[0].encode(), bind[1].encode(), None, MS_BIND, None)
    for target in targets:
        try:
            _mount(str(tmp).encode(), target.encode(), None, MS_BIND, None)
        except OSError as exc:
            # a folder gone since the agent looked has nothing to share (``spawn.c``)
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
    if shm:
        _mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=1777,size=64m")


def _unshare(flag: int) -> None:
    if _libc.unshare(flag) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare: {os.strerror(errno)}")


#: keyctl(2)'s number, for a fork of the agent (the spawn helper has ``SYS_keyctl``)
_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())
_JOIN, _EMPTY, _PERSISTENT = 1, 7, 22
_SESSION, _USER, _USER_SESSION = -3, -4, -5


def _keyctl(*args: int | None) -> int:
    assert _KEYCTL is not None
    result = int(_libc.syscall(_KEYCTL, *(ctypes.c_long(a) if a is not None else a for a in args)))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"keyctl: {os.strerror(code)}")
    return result


#: a keyring that the uid's quota had no room to make held nothing, and without keys
#: (or persistent keyrings) in the kernel there is nothing to empty
_NOTHING_THERE = (errno.ENOSYS, errno.EOPNOTSUPP, errno.EDQUOT)


def join_keyring() -> bool:
    """As root, before the uid is dropped: a session keyring of the attempt's own
    (``spawn.c``, ``join_keyring``, says why); False where there are no keyrings (no
    keys in the kernel, or a seccomp filter refuses ``keyctl``: ENOSYS, EPERM)."""
    if _KEYCTL is None:
        return False
    try:
        _keyctl(_JOIN, None)
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM):
            return False
        raise
    return True


def empty_keyrings() -> None:
    """As the attempt's uid: its user, user-session and persistent keyrings emptied of
    what an earlier attempt of the uid left (``spawn.c``, ``empty_keyrings``)."""
    for ring in (_USER, _USER_SESSION):
        with _tolerating(*_NOTHING_THERE):
            _keyctl(_EMPTY, ring)
    with _tolerating(*_NOTHING_THERE):
        _keyctl(_EMPTY, _keyctl(_PERSISTENT, -1, _SESSION))


@contextlib.contextmanager
def _tolerating(*codes: int) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno not in codes:
            raise


def own_network() -> None:
    """Enter a network namespace of its own, with loopback up and nothing else."""
    _unshare(CLONE_NEWNET)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def join_network(pid: int) -> None:
    """Enter the network namespace of process ``pid`` (this thread only)."""
    _join(pid, "net", CLONE_NEWNET)


def _join(pid: int, kind: str, flag: int) -> None:
    """Enter the ``kind`` namespace of process ``pid`` (``setns``)."""
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, flag) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns: {os.strerror(errno)}")
    finally:
        os.close(fd)


def socket_in_network(pid: int) -> socket.socket:
    """A TCP socket of the network namespace of process ``pid``: made by a thread of its
    own that enters that namespace and ends, so no other thread of the agent leaves the
    host's network (a socket keeps the namespace it was made in)."""
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            join_network(pid)
            made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the caller
            made.append(exc)

    thread = threading.Thread(target=make, name=f"netns-{pid}", daemon=True)
    thread.start()
    thread.join()
    if not made:
        raise OSError(f"no socket in the network of process {pid}")
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def mount_namespaces_work() -> bool:
    """Whether this host lets the agent give an attempt its own mount namespace."""

    def probe() -> None:
        if _libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        _mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)

    return _works(probe)


def ipc_namespaces_work() -> bool:
    """Whether this host lets the agent give an attempt its own IPC namespace."""
    return _works(lambda: _unshare(CLONE_NEWIPC))


def _works(probe: Callable[[], None]) -> bool:
    """Whether a child that runs ``probe`` before its exec starts."""
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


#: file systems the look for world-writable folders does not enter: the kernel's own, and
#: network, FUSE and automounted ones (slow or hanging to walk; walking an automount
#: mounts it)
NOT_WALKED = frozenset(
    {
        "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
        "bpf", "configfs", "fusectl", "binfmt_misc", "nsfs", "efivarfs", "hugetlbfs",
        "rpc_pipefs", "autofs", "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph",
        "glusterfs", "9p", "afs", "davfs", "lustre", "gpfs", "sshfs",
    }
)  # fmt: skip
#: how far the look goes: entries read, seconds, folders deep, and folders found (each
#: is a bind in every attempt's start)
WALK_ENTRIES, WALK_S, WALK_DEPTH, WRITABLE_MAX = 1_000_000, 3.0, 12, 64
#: the folders every attempt has of its own: its tmp (bound on /tmp and /var/tmp) and a
#: fresh /dev/shm; the host's other world-writable folders get its tmp bound on them too
OWN_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # noqa: S108 - the folders themselves
#: how long agents of a host starting one after another take the last look's answer
#: (same boot, same mounts) instead of walking the file systems again (0.3-0.8 s here)
WRITABLE_KEPT_S = 300.0


def _not_walked(mountinfo: str = "/proc/self/mountinfo") -> set[str]:
    """The mount points of ``NOT_WALKED`` file systems (and FUSE's)."""
    skip: set[str] = set()
    with contextlib.suppress(OSError), open(mountinfo, encoding="utf-8") as lines:
        for line in lines:
            left, _, right = line.partition(" - ")
            fields, kind = left.split(), right.split()[:1]
            if len(fields) < 5 or not kind:
                continue
            if kind[0] in NOT_WALKED or kind[0].startswith("fuse"):
                # mountinfo escapes space, tab, newline and backslash as octal
                skip.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]))
    return skip


def world_writable_folders(leave: set[str], top: str = "/") -> tuple[list[str], str | None]:
    """The folders under ``top`` every uid may write in (o+w) and reach (each folder
    above them o+x): an attempt could leave files there for the next attempt given its
    uid, past its disk quota. Not entered: ``leave``, folders others may not pass
    (nothing below them is reachable), those found (their contents are shadowed whole),
    ``NOT_WALKED`` file systems and symbolic links. Bounded (``WALK_*``,
    ``WRITABLE_MAX``): returns what was found and, when a bound cut the look short, why."""
    skip = _not_walked() | leave
    found: list[str] = []
    deadline = time.monotonic() + WALK_S
    stack = [(top, 0)]
    seen = 0
    while stack:
        path, depth = stack.pop()
        for entry, mode in _folders_in(path):
            seen += 1
            if seen > WALK_ENTRIES or (seen % 4096 == 0 and time.monotonic() > deadline):
                return sorted(found), f"stopped after {seen - 1} folders ({WALK_S:g} s at most)"
            if entry in skip:
                continue
            if mode & stat.S_IWOTH:
                found.append(entry)
                if len(found) == WRITABLE_MAX:
                    return sorted(found), f"stopped at {WRITABLE_MAX} folders"
            elif mode & stat.S_IXOTH and depth < WALK_DEPTH:
                stack.append((entry, depth + 1))
    return sorted(found), None


def _folders_in(path: str) -> Iterator[tuple[str, int]]:
    """The folders right in ``path`` (not symbolic links), with their modes."""
    try:
        entries = os.scandir(path)
    except OSError:
        return
    with entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    yield entry.path, entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue


def host_writable_folders(kept_in: Path) -> tuple[list[str], str | None]:
    """``world_writable_folders`` of this host outside ``OWN_TMP``, as a look by any
    agent of the host within ``WRITABLE_KEPT_S`` (the same boot and mounts) found them:
    kept in ``kept_in`` (the uid locks' folder: this user's, others cannot write it), in
    a file trusted only when it is this user's and no one else may write it."""
    kept = kept_in / "world-writable.json"
    key = _mounts_key()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        fd = os.open(kept, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            fresh = time.time() - info.st_mtime < WRITABLE_KEPT_S
            if info.st_uid == os.geteuid() and not info.st_mode & 0o022 and fresh:
                told = json.loads(file.read(1 << 20))
                found, cut = told["found"], told["cut"]
                paths = isinstance(found, list) and all(
                    isinstance(p, str) and p.startswith("/") for p in found
                )
                if told["key"] == key and paths and isinstance(cut, str | None):
                    return found, cut
    found, cut = world_writable_folders(set(OWN_TMP))
    with contextlib.suppress(OSError):
        part = kept_in / f".world-writable.{os.getpid()}"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump({"key": key, "found": found, "cut": cut}, file)
        os.replace(part, kept)
    return found, cut


def _mounts_key() -> str:
    """This boot and its mount table: a look's answer holds while both do."""
    digest = hashlib.sha256()
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/mountinfo"):
        with contextlib.suppress(OSError), open(source, "rb") as file:
            digest.update(file.read(4 << 20))
    return digest.hexdigest()


class UidPool:
    """The uids this agent may hand out, each held by a lock file while in use."""

    def __init__(self, uids: range, lock_dir: Path) -> None:
        self.uids = uids
        self.lock_dir = lock_dir
        self._lock_prefix = f"{lock_dir}/"  # a lock file's path, with no Path made
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
                f"{self._lock_prefix}{uid}",
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
    #: the attempt's tmpfs (``tmpfs``), attached on ``home`` in its mount namespace; None:
    #: its home and tmp are folders on the run folder's file system
    mount: int | None = None
    quota_mb: int | None = None
    #: ``executable`` is a placeholder (``workdirs.Workdirs.placeholder``): the sealed
    #: copy is bound on it in the attempt's mount namespace (``bound``), no file is linked
    placeholder: bool = False
    #: the sealed copy (``artifacts.Sealed``) bound on ``executable`` when it starts
    bound: Path | None = None
    #: its ``file://`` source and the stamp it must still have, checked by its spawn
    #: helper's checker as the attempt before anything else (``spawner.Launch.source``)
    source_check: tuple[Path, tuple[int, int, int, int, int]] | None = None
    #: lets go of the sealed copy ``bound`` names (``artifacts.Sealed.hold``), kept from
    #: the cache's eviction until these folders are given back (``workdirs.give_back``)
    unbind: Callable[[], None] | None = None

    @property
    def view(self) -> Path:
        """Where the agent reads the attempt's files (its home)."""
        return tmpfs.view(self.mount) if self.mount is not None else self.home

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
        the agent's, 0555), in a folder only the attempt's gid may search; or, on a
        ``placeholder``, the copy bound on it in the attempt's mount namespace (nothing
        made here)."""
        if self.placeholder:
            self.bound = sealed
            return
        os.link(sealed, self.executable)

    def remove(self) -> None:
        self.unmount()
        for folder in self.made:
            remove_tree(folder)

    def unmount(self) -> None:
        """Let the tmpfs go (freed once the attempt's namespace is gone too)."""
        mount, self.mount = self.mount, None
        tmpfs.close(mount)


#: how a folder an attempt wrote into is opened: never through a link, never blocking (a
#: fifo swapped in for it by ``RENAME_EXCHANGE`` fails with ``ENOTDIR`` instead)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: the removal walk's bounds: entries handled, seconds, folders open at once (a deeper
#: folder is moved up to the top one, so a tree of any depth needs no more descriptors)
REMOVE_MAX_ENTRIES = 200_000
REMOVE_MAX_SECONDS = 10.0
_REMOVE_MAX_OPEN = 32
_moved = itertools.count(1)


class _Entries(Iterator[os.DirEntry[str]], Protocol):
    """What ``os.scandir`` on a descriptor gives: entries, to be closed."""

    def close(self) -> None: ...


def remove_tree(path: Path) -> bool:
    """Remove a file or a folder an attempt wrote into (and may still be changing); links
    in it are removed, never followed. True when it is gone; False when the walk gave up
    after its bounds (``REMOVE_MAX_ENTRIES``, ``REMOVE_MAX_SECONDS``) or met an error
    (logged): the rest is left for a later pass."""
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
        return False
    try:
        return _remove_at(parent, path.name, path)
    finally:
        os.close(parent)


def _remove_at(parent: int, name: str, path: Path) -> bool:
    walk = _Removal(parent)
    try:
        walk.enter(parent, name)
        while walk.stack:
            if not walk.step():
                log.warning("gave up removing %s (too large or too slow); left for later", path)
                return False
        return True
    except OSError as exc:
        log.warning("cannot remove %s: %s; left for later", path, exc)
        return False
    finally:
        for level in reversed(walk.stack):
            _close(level)


class _Removal:
    """One removal walk, iterative: a stack of open folders (each level: its descriptor,
    its name in the level above, its entries, streamed), bounded in entries and time."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.stack: list[tuple[int, str, _Entries]] = []
        self.deadline = time.monotonic() + REMOVE_MAX_SECONDS
        self.budget = REMOVE_MAX_ENTRIES

    def enter(self, fd: int, name: str) -> None:
        folder = _open_or_unlink(fd, name)
        if folder is not None:
            self.stack.append(_level(folder, name))

    def step(self) -> bool:
        """Handle one entry; False once over the bounds."""
        self.budget -= 1
        if self.budget < 0 or time.monotonic() > self.deadline:
            return False
        fd, own, entries = self.stack[-1]
        entry = next(entries, None)
        if entry is None:
            self._leave(own)
        elif not entry.is_dir(follow_symlinks=False) and _unlinked(fd, entry.name):
            pass
        elif len(self.stack) >= _REMOVE_MAX_OPEN:  # moved up to the top folder, for later
            moved = f".cairn-deep-{os.getpid()}-{next(_moved)}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(entry.name, moved, src_dir_fd=fd, dst_dir_fd=self.stack[0][0])
        else:
            self.enter(fd, entry.name)
        return True

    def _leave(self, own: str) -> None:
        _close(self.stack.pop())
        up = self.stack[-1][0] if self.stack else self.parent
        try:
            os.rmdir(own, dir_fd=up)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
            self.enter(up, own)  # something was added meanwhile: again, within the bounds


def _unlinked(fd: int, name: str) -> bool:
    """Unlink a name that was not a folder; False if it is one now (swapped in)."""
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        return False
    return True


def _open_or_unlink(fd: int, name: str) -> int | None:
    """The folder ``name`` opened (relative to ``fd``, never through a link, never
    blocking), or None when it was not a folder (then unlinked) or is gone."""
    for _ in range(3):
        try:
            folder = os.open(name, _OPEN_DIR, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                if _unlinked(fd, name):
                    return None
            elif exc.errno == errno.EACCES and os.geteuid() != 0:
                # An attempt may leave folders of mode 0 behind; as root that does not
                # matter, but a non-root agent (isolation none, attempts run as its own
                # uid: no one to trust less) needs the bits to empty them.
                os.chmod(name, 0o700, dir_fd=fd)
            else:
                raise
        else:
            if os.geteuid() != 0:
                with contextlib.suppress(OSError):
                    os.fchmod(folder, 0o700)  # its entries may be unlinked
            return folder
    raise OSError(errno.EAGAIN, "changes while being removed", name)


def _level(fd: int, name: str) -> tuple[int, str, _Entries]:
    try:
        return fd, name, os.scandir(fd)
    except BaseException:
        os.close(fd)
        raise


def _close(level: tuple[int, str, _Entries]) -> None:
    fd, _, entries = level
    try:
        entries.close()
    finally:
        os.close(fd)
