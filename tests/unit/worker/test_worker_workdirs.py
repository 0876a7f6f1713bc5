"""Attempts' folders made ahead (``services.worker.workdirs``) and executables run through
a hard link to a sealed verified copy (``artifacts.Sealed``), as root: nothing a hostile
attempt leaves or keeps (files, descriptors, watches, trees deep or changing) reaches the
next attempt, and its removal never blocks nor escapes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.worker import isolation
from services.worker.artifacts import ArtifactCache, ArtifactError, Sealed
from services.worker.isolation import Identity, remove_tree
from services.worker.workdirs import SpareLogs, Workdirs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="folders are given to uids as root")

FIRST, SECOND = Identity(29991, 29991), Identity(29992, 29992)
ACCOMPLICE = Identity(29993, 29993)  # a process of another attempt, still running
# The accomplices run as other uids, which may not reach the venv's interpreter (a pyenv
# build under a 0700 /root): Debian's own, which any uid can run; they need only the stdlib.
UNPRIVILEGED_PYTHON = (
    "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
)


@pytest.fixture
def workdirs(root: Path) -> Workdirs:
    run = root / "run"
    run.mkdir(mode=0o711)
    dirs = Workdirs(run, isolated=True, keep=4)
    dirs.start(ahead=1)
    return dirs


def _inode(path: Path) -> int:
    return path.lstat().st_ino


def _as(identity: Identity, script: str, cwd: Path) -> None:
    subprocess.run(
        ["/bin/sh", "-c", script],
        user=identity.uid,
        group=identity.gid,
        extra_groups=[],
        cwd=cwd,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )


def test_a_folder_comes_back_empty_and_private_whatever_its_attempt_left(
    workdirs: Workdirs, root: Path
) -> None:
    outside = root / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    folders = workdirs.make(101, "run", FIRST)
    home, tmp = folders.home, folders.tmp
    assert (home.stat().st_uid, tmp.stat().st_uid) == (FIRST.uid, FIRST.uid)
    _as(
        FIRST,
        f"echo secret > secret; mkfifo fifo; ln -s {outside}/keep link; ln -s {outside} dirlink; "
        "mkdir -p a/b/c && echo x > a/b/c/f && chmod 0 a/b; echo t > tmp/left; "
        "d=deep; for i in $(seq 300); do d=$d/d; done; mkdir -p $d; chmod 777 .",
        home,
    )
    os.setxattr(home, "user.note", b"from the first attempt")
    workdirs.give_back(folders, reusable=True)
    assert not home.exists() and (outside / "keep").read_text() == "precious"

    again = workdirs.make(102, "run", SECOND)
    assert workdirs.made == 0 and workdirs.ahead == 1  # made ahead, when 101 ended
    assert os.listdir(again.home) == ["tmp"] and os.listdir(again.tmp) == []
    for folder in (again.home, again.tmp):
        info = folder.lstat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (
            SECOND.uid,
            SECOND.gid,
            0o700,
        )
        assert os.listxattr(folder) == []
    assert outside.stat().st_uid == 0 and sorted(os.listdir(outside)) == ["keep"]


def test_a_tmp_swapped_for_a_link_is_never_followed_and_the_folder_is_replaced(
    workdirs: Workdirs, root: Path
) -> None:
    outside = root / "outside"
    outside.mkdir(mode=0o755)
    (outside / "keep").write_text("precious")
    folders = workdirs.make(201, "run", FIRST)
    _as(FIRST, f"mv tmp old && ln -s {outside} tmp", folders.home)
    workdirs.give_back(folders, reusable=True)
    again = workdirs.make(202, "run", SECOND)
    assert again.tmp.is_dir() and not again.tmp.is_symlink() and os.listdir(again.home) == ["tmp"]
    assert outside.stat().st_uid == 0 and stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert (outside / "keep").read_text() == "precious"


def test_the_executable_folder_of_an_attempt_not_known_to_be_over_is_not_reused(
    workdirs: Workdirs,
) -> None:
    folders = workdirs.make(301, "run", FIRST)
    workdirs.give_back(folders, reusable=True)
    reused = workdirs.reused
    folders = workdirs.make(302, "run", SECOND)
    assert workdirs.reused == reused + 1  # 301's, emptied
    workdirs.give_back(folders, reusable=False)  # its cgroup was not seen empty
    assert not folders.home.exists() and not folders.executable.parent.exists()
    workdirs.make(303, "run", FIRST)
    assert workdirs.reused == reused + 1


SCRIPT = b"#!/bin/sh\necho sealed\n"
DIGEST = hashlib.sha256(SCRIPT).hexdigest()


@pytest.fixture
def source(root: Path) -> Path:
    path = root / "script.sh"
    path.write_bytes(SCRIPT)
    path.chmod(0o644)
    return path


def _sealing(workdirs: Workdirs, root: Path) -> tuple[Path, Sealed, ArtifactCache]:
    """The agent's sealed copies in its pool folder, and an artifact cache beside them."""
    sealed_dir = workdirs.pool / "sealed"
    sealed_dir.mkdir(mode=0o700)
    return sealed_dir, Sealed(sealed_dir, 2**20), ArtifactCache(root / "cache")


def test_attempts_run_one_sealed_copy_that_none_of_them_can_change(
    workdirs: Workdirs, root: Path, source: Path
) -> None:
    sealed_dir, sealed, cache = _sealing(workdirs, root)
    first, second = workdirs.make(401, "run", FIRST), workdirs.make(402, "run", SECOND)
    for folders, reader in ((first, FIRST), (second, SECOND)):
        made = cache.seal_local(source.as_uri(), DIGEST, reader, sealed)
        folders.link_executable(made)
    assert made.parent == sealed_dir
    assert first.executable.samefile(second.executable)
    info = first.executable.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode), info.st_nlink) == (0, 0o555, 3)
    exe_dir = first.executable.parent.stat()
    assert (exe_dir.st_uid, exe_dir.st_gid, stat.S_IMODE(exe_dir.st_mode)) == (
        0,
        FIRST.gid,
        0o710,
    )
    listing = subprocess.run(
        ["/bin/ls", str(first.executable.parent)],
        user=FIRST.uid,
        group=FIRST.gid,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    assert listing.returncode != 0  # its gid passes through the folder, cannot list it
    ran = subprocess.run(
        [str(first.executable)],
        user=FIRST.uid,
        group=FIRST.gid,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    assert ran.stdout == b"sealed\n"
    run = subprocess.run(
        ["/bin/sh", "-c", f'echo pwned > "{first.executable}"; chmod 777 "{first.executable}"'],
        user=FIRST.uid,
        group=FIRST.gid,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    assert run.returncode != 0 and first.executable.read_bytes() == SCRIPT
    stranger = subprocess.run(
        ["/bin/cat", str(first.executable)],
        user=SECOND.uid,
        group=SECOND.gid,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    assert stranger.returncode != 0  # the other attempt's gid cannot enter its folder
    workdirs.give_back(first, reusable=True)
    workdirs.give_back(second, reusable=True)
    assert made.stat().st_nlink == 1


def test_a_sealed_file_artifact_is_not_what_a_download_of_its_digest_gets(
    workdirs: Workdirs, root: Path, source: Path
) -> None:
    _, sealed, cache = _sealing(workdirs, root)
    cache.seal_local(source.as_uri(), DIGEST, FIRST, sealed)
    # Nothing listens there: only a fetch can answer, not the file only FIRST may read.
    with pytest.raises(ArtifactError, match="ConnectError"):
        asyncio.run(cache.seal("https://127.0.0.1:9/tool", DIGEST, sealed))


def test_a_file_source_is_read_as_the_attempt_and_hashed_each_time_a_copy_is_sealed(
    workdirs: Workdirs, root: Path, source: Path
) -> None:
    _, sealed, cache = _sealing(workdirs, root)
    copy = cache.seal_local(source.as_uri(), DIGEST, FIRST, sealed)
    assert cache.seal_local(source.as_uri(), DIGEST, FIRST, sealed) == copy
    source.chmod(0o600)  # root's alone now: the sealed copy does not stand in for it
    with pytest.raises(ArtifactError, match="not readable by the attempt"):
        cache.seal_local(source.as_uri(), DIGEST, FIRST, sealed)
    source.chmod(0o644)
    source.write_bytes(b"#!/bin/sh\necho changed\n")
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        cache.seal_local(source.as_uri(), DIGEST, FIRST, sealed)
    source.write_bytes(SCRIPT)
    before = copy.stat().st_ino
    copy.chmod(0o755)  # no longer as sealed: made again, not trusted
    assert cache.seal_local(source.as_uri(), DIGEST, FIRST, sealed).stat().st_ino != before


def test_a_log_is_used_again_only_once_no_other_process_holds_it_open(root: Path) -> None:
    logs = root / "logs"
    logs.mkdir(mode=0o700)
    spares = SpareLogs(logs, keep=4)
    spares.start()
    first = logs / "1.log"
    first.write_text("the first attempt's output\n")
    inode = _inode(first)
    spares.give_back(first)
    spares.take(logs / "2.log")
    assert _inode(logs / "2.log") == inode and (logs / "2.log").read_bytes() == b""
    assert spares.reused == 1

    # A process that kept the attempt's output descriptor (handed over a socket, say).
    with (logs / "2.log").open("ab") as output:
        holder = subprocess.Popen(
            ["/bin/sh", "-c", "read line; echo injected"], stdin=subprocess.PIPE, stdout=output
        )
    try:
        spares.give_back(logs / "2.log")
        spares.take(logs / "3.log")
        assert not (logs / "3.log").exists() and spares.reused == 1  # not handed out
    finally:
        assert holder.stdin is not None
        holder.stdin.write(b"go\n")
        holder.stdin.close()
        holder.wait(timeout=10)
    assert os.listdir(spares.spare) == []


# The accomplice: a process of another attempt (another uid, its own cgroup, still
# running). It gets descriptors on the attempt's folders (it opens them itself here, which
# is what the attempt passing them over an abstract unix socket amounts to), then, long
# after the attempt's cgroup was seen empty, lists them and reads inotify events.
ACCOMPLICE_SCRIPT = r"""
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
home, tmp = sys.argv[1], sys.argv[2]
fds = [os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in (home, tmp)]
ino = libc.inotify_init1(0o4000)  # IN_NONBLOCK
for p in (home, tmp):
    assert libc.inotify_add_watch(ino, p.encode(), 0x100 | 0x2 | 0x20) >= 0
print("ready", flush=True)
sys.stdin.readline()
seen = []
for fd in fds:
    seen += os.listdir(fd)  # getdents: read permission was checked at open, never again
try:
    data = os.read(ino, 65536)
except BlockingIOError:
    data = b""
while data:
    wd, mask, cookie, n = struct.unpack_from("iIII", data)
    name = data[16:16 + n].rstrip(b"\0").decode()
    if name:
        seen.append("inotify:" + name)
    data = data[16 + n:]
print("seen " + " ".join(seen), flush=True)
"""


def test_a_descriptor_kept_by_another_process_never_sees_into_the_next_attempts_folder(
    workdirs: Workdirs, root: Path
) -> None:
    script = root / "accomplice.py"
    script.write_text(ACCOMPLICE_SCRIPT)
    script.chmod(0o644)
    folders = workdirs.make(501, "run", FIRST)
    _as(FIRST, "chmod 755 . tmp", folders.home)  # the owner may; or pass fds over a socket
    accomplice = subprocess.Popen(
        [UNPRIVILEGED_PYTHON, "-I", str(script), str(folders.home), str(folders.tmp)],
        user=ACCOMPLICE.uid,
        group=ACCOMPLICE.gid,
        extra_groups=[],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert accomplice.stdout is not None and accomplice.stdin is not None
        assert accomplice.stdout.readline().strip() == "ready"
        workdirs.give_back(folders, reusable=True)  # its cgroup was seen empty
        later = workdirs.make(502, "run", SECOND)
        _as(SECOND, "echo s > payroll.csv; echo k > tmp/session-key", later.home)
        accomplice.stdin.write("go\n")
        accomplice.stdin.flush()
        seen = accomplice.stdout.readline().split()
    finally:
        accomplice.kill()
        accomplice.communicate()
    assert seen[0] == "seen"  # the removal's own events (its tmp opened) at most:
    assert not {"payroll.csv", "session-key"} & {name.removeprefix("inotify:") for name in seen}


def test_a_tree_deeper_than_the_recursion_limit_is_removed_and_nothing_leaks(
    workdirs: Workdirs,
) -> None:
    folders = workdirs.make(601, "run", FIRST)
    os.link(__file__, folders.executable)  # stands for the hard link to the sealed copy
    depth = sys.getrecursionlimit() + 300
    _as(FIRST, f"mkdir -p $(printf 'd/%.0s' $(seq {depth}))", folders.home)
    workdirs.give_back(folders, reusable=True)
    assert not folders.home.exists() and not folders.executable.exists()
    assert sorted(os.listdir(workdirs.pool)) == sorted(
        p.name for p in (*workdirs._homes, *workdirs._exes)
    )


# Swaps, through a descriptor on a folder inside the attempt's home, a folder with a fifo
# (renameat2 RENAME_EXCHANGE), so that a removal that checks a name then opens it without
# O_DIRECTORY|O_NONBLOCK (shutil.rmtree of 3.11) opens a fifo and blocks.
SWAPPER_SCRIPT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
print("ready", flush=True)
while True:
    libc.syscall(316, fd, b"d0", fd, b"f0", 2)  # renameat2(..., RENAME_EXCHANGE)
"""


def _release(folder: Path) -> None:
    """Open each fifo left for writing: whatever blocked opening one for reading goes on."""
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):
            os.close(os.open(folder / name, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_swapped_in_by_another_uid_never_blocks_the_removal(
    workdirs: Workdirs, root: Path
) -> None:
    script = root / "swapper.py"
    script.write_text(SWAPPER_SCRIPT)
    script.chmod(0o644)
    for attempt_id in range(701, 721):
        folders = workdirs.make(attempt_id, "run", FIRST)
        _as(FIRST, "chmod 711 .; mkdir -m 777 s s/d0; mkfifo -m 666 s/f0", folders.home)
        swapper = subprocess.Popen(
            [UNPRIVILEGED_PYTHON, "-I", str(script), str(folders.home / "s")],
            user=ACCOMPLICE.uid,
            group=ACCOMPLICE.gid,
            extra_groups=[],
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        try:
            assert swapper.stdout is not None and swapper.stdout.readline().strip() == "ready"
            removal = threading.Thread(target=workdirs.give_back, args=(folders, True))
            removal.start()
            removal.join(5)
            hung = removal.is_alive()
        finally:
            swapper.kill()
            swapper.communicate()
        if hung:
            _release(folders.home / "s")
            removal.join(5)
        assert not hung, f"the removal blocked (try {attempt_id - 700})"
        assert not folders.home.exists()


def test_a_removal_over_its_bounds_gives_up_and_a_later_tidy_finishes_it(
    workdirs: Workdirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    folders = workdirs.make(801, "run", FIRST)
    _as(FIRST, "mkdir -p a/b && touch a/b/1 a/b/2 a/b/3 a/b/4 a/b/5 a/b/6", folders.home)
    monkeypatch.setattr(isolation, "REMOVE_MAX_ENTRIES", 5)
    workdirs.give_back(folders, reusable=True)  # never raises: logged, set aside
    assert not folders.home.exists() and len(workdirs._leftover) == 1
    left = workdirs._leftover[0]
    assert left.exists()
    assert not remove_tree(left)  # still over the bound, nothing raised
    monkeypatch.setattr(isolation, "REMOVE_MAX_ENTRIES", 100)
    workdirs.tidy()
    assert workdirs._tidying is not None
    workdirs._tidying.join(10)
    assert not left.exists() and workdirs._leftover == []
