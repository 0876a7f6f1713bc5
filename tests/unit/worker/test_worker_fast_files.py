"""The agent's per-attempt file work made cheap without weakening it: a pooled slot's
control files kept open (``cgroups.ControlFiles``) and one resident thread that opens
``file://`` artifacts with each attempt's own permissions (``artifacts._Opener``)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from services.worker import artifacts, cgroups
from services.worker.cgroups import ControlFiles
from services.worker.isolation import Identity
from services.worker.settings import SOURCE_TIMEOUT_S

LIMIT_S = SOURCE_TIMEOUT_S


def test_control_files_read_and_write_the_current_value_through_one_descriptor(
    tmp_path: Path,
) -> None:
    knob = tmp_path / "cpu.cfs_quota_us"
    knob.write_text("1000")
    files = ControlFiles()
    assert files.read(knob) == "1000"
    knob.write_text("2000")  # changed by someone else: a read at offset 0 sees it
    assert files.read(knob) == "2000"
    files.write(knob, "3000")
    assert knob.read_text() == "3000"
    assert len(files._fds) == 1
    files.close()
    assert files._fds == {}


def test_control_files_fall_back_to_a_fresh_open_without_descriptors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    knob = tmp_path / "memory.max_usage_in_bytes"
    knob.write_text("12345")
    real_open = os.open

    def no_descriptors(path: object, flags: int, *args: int) -> int:
        if flags & os.O_RDWR:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cgroups.os, "open", no_descriptors)
    files = ControlFiles()
    assert files.read(knob) == "12345"
    files.write(knob, "0")
    assert knob.read_text() == "0"
    assert files._fds == {}


def test_a_refused_write_raises_and_the_next_one_opens_again(tmp_path: Path) -> None:
    files = ControlFiles()
    with pytest.raises(OSError):
        files.write(tmp_path / "missing" / "pids.max", "5")
    knob = tmp_path / "pids.max"
    knob.write_text("max")
    files.write(knob, "065")  # (a regular file keeps what a pwrite does not cover)
    assert knob.read_text() == "065"


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid's permissions needs root")
def test_one_opener_thread_takes_each_readers_permissions_in_turn() -> None:
    folder = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        folder.chmod(0o755)
        first, second = Identity(29997, 29997), Identity(29998, 29998)
        mine = folder / "first-only"
        mine.write_bytes(b"x")
        os.chown(mine, first.uid, first.gid)
        mine.chmod(0o600)
        flags = os.O_RDONLY | os.O_CLOEXEC
        for _ in range(3):  # the same thread, switching back and forth
            os.close(artifacts._open_as(mine, first, LIMIT_S))
            with pytest.raises(PermissionError):
                artifacts._open_as(mine, second, LIMIT_S)
        with pytest.raises(PermissionError):  # root's own file, 0600: not for an attempt
            rootonly = folder / "root-only"
            rootonly.write_bytes(b"y")
            rootonly.chmod(0o600)
            artifacts._open_as(rootonly, first, LIMIT_S)
        # One thread took them all in turn (``_Guard``'s spare, kept between opens).
        openers = [t for t in threading.enumerate() if t.name == "open-with-limit"]
        assert len(openers) == 1
        # The asking thread kept root's permissions: it still reads root's own file.
        os.close(os.open(rootonly, flags))
    finally:
        shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid's permissions needs root")
def test_the_opener_survives_a_name_it_cannot_open() -> None:
    with pytest.raises(ValueError):
        artifacts._open_as(Path("/tmp/a\0b"), Identity(29997, 29997), LIMIT_S)
    with pytest.raises(FileNotFoundError):
        artifacts._open_as(Path("/nonexistent/cairn-test"), Identity(29997, 29997), LIMIT_S)


def test_the_agents_board_is_the_json_the_sidecar_reads() -> None:
    from services.worker import state

    board = state.Board.create()
    try:
        held = state.Holdings()
        held.confine(7, ["/x", '/sys/fs/cgroup/odd "name"/s1'], 60001)
        held.confine(8, None, 60002)
        held.confine(6, ["/y"], None)  # reported: off the attempts, its cgroup still to kill
        pids = {7: 4321, 8: 0, 9: 0}  # 8 ended: its pid may name another group now
        board.write_json(held.encode(4242, 9, pids, {9}))
        assert board.read() == {
            "agent_pid": 4242,
            "seen": 9,
            "attempts": {"7": 4321, "8": 0, "9": -1},
            "cgroups": {"7": ['/sys/fs/cgroup/odd "name"/s1', "/x"], "6": ["/y"]},
            "uids": {"7": 60001, "8": 60002},
        }
        held.unconfine(6)
        held.unconfine(7)
        board.write_json(held.encode(4242, 10, pids, ()))
        assert board.read() == {
            "agent_pid": 4242,
            "seen": 10,
            "attempts": {"7": 4321, "8": 0, "9": 0},
            "cgroups": {},
            "uids": {"8": 60002},
        }
    finally:
        board.close()
