"""Attempts' folders used again (``services.worker.workdirs``) and executables run through
a hard link to a sealed verified copy (``artifacts.Sealed``), as root: what a hostile
attempt leaves in its folder never reaches the next one, and a folder it changed in a way
emptying cannot undo is replaced, not reused."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.worker.artifacts import ArtifactCache, ArtifactError, Sealed
from services.worker.isolation import Identity
from services.worker.workdirs import MAX_DIR_BYTES, SpareLogs, Workdirs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="folders are given to uids as root")

FIRST, SECOND = Identity(29991, 29991), Identity(29992, 29992)


@pytest.fixture
def root() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="cairn-workdirs-test-", dir="/var/tmp"))
    folder.chmod(0o711)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


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
    inodes = _inode(home), _inode(tmp)
    workdirs.give_back(folders, reusable=True)
    assert not home.exists() and (outside / "keep").read_text() == "precious"

    again = workdirs.make(102, "run", SECOND)
    assert (_inode(again.home), _inode(again.tmp)) == inodes  # the same folders, reused
    assert workdirs.reused == 2 and workdirs.made == 0
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
    made = workdirs.made
    again = workdirs.make(202, "run", SECOND)
    assert workdirs.made == made + 1  # a new set: (inode numbers may be the same again)
    assert again.tmp.is_dir() and not again.tmp.is_symlink() and os.listdir(again.home) == ["tmp"]
    assert outside.stat().st_uid == 0 and stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert (outside / "keep").read_text() == "precious"


def test_a_folder_grown_large_or_of_an_attempt_not_known_to_be_over_is_not_reused(
    workdirs: Workdirs,
) -> None:
    folders = workdirs.make(301, "run", FIRST)
    for i in range(MAX_DIR_BYTES // 16):
        (folders.home / f"name-{i:06d}").touch()
    workdirs.give_back(folders, reusable=True)
    made = workdirs.made
    workdirs.give_back(workdirs.make(302, "run", SECOND), reusable=True)
    assert workdirs.made == made + 1

    folders = workdirs.make(303, "run", FIRST)
    assert workdirs.made == made + 1  # 302's set, reused
    workdirs.give_back(folders, reusable=False)  # its cgroup was not seen empty
    assert not folders.home.exists()
    workdirs.make(304, "run", SECOND)
    assert workdirs.made == made + 2


SCRIPT = b"#!/bin/sh\necho sealed\n"
DIGEST = hashlib.sha256(SCRIPT).hexdigest()


@pytest.fixture
def source(root: Path) -> Path:
    path = root / "script.sh"
    path.write_bytes(SCRIPT)
    path.chmod(0o644)
    return path


def test_attempts_run_one_sealed_copy_that_none_of_them_can_change(
    workdirs: Workdirs, root: Path, source: Path
) -> None:
    sealed_dir = workdirs.pool / "sealed"
    sealed_dir.mkdir(mode=0o700)
    sealed = Sealed(sealed_dir, 2**20)
    cache = ArtifactCache(root / "cache")
    first, second = workdirs.make(401, "run", FIRST), workdirs.make(402, "run", SECOND)
    for folders, reader in ((first, FIRST), (second, SECOND)):
        folders.link_executable(cache.seal_local(source.as_uri(), DIGEST, reader, sealed))
    assert first.executable.samefile(second.executable)
    info = first.executable.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode), info.st_nlink) == (0, 0o555, 3)
    exe_dir = first.executable.parent.stat()
    assert (exe_dir.st_uid, exe_dir.st_gid, stat.S_IMODE(exe_dir.st_mode)) == (
        0,
        FIRST.gid,
        0o750,
    )
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
    assert (sealed_dir / DIGEST).stat().st_nlink == 1


def test_a_file_source_is_read_as_the_attempt_and_hashed_each_time_a_copy_is_sealed(
    workdirs: Workdirs, root: Path, source: Path
) -> None:
    sealed_dir = workdirs.pool / "sealed"
    sealed_dir.mkdir(mode=0o700)
    sealed = Sealed(sealed_dir, 2**20)
    cache = ArtifactCache(root / "cache")
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
