"""The look for the host's world-writable folders (``isolation.world_writable_folders``),
on whose every one an attempt's own tmp is bound: what it finds and does not enter, its
bounds, and the answer agents of a host share for a while (``host_writable_folders``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.worker import isolation


def _folder(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def test_it_finds_reachable_world_writable_folders_and_enters_none_it_need_not(
    tmp_path: Path,
) -> None:
    top = _folder(tmp_path / "top", 0o755)
    found = _folder(_folder(top / "a", 0o755) / "drop", 0o1777)
    _folder(found / "inside", 0o777)  # shadowed whole with its parent: not listed
    _folder(_folder(top / "closed", 0o700) / "drop", 0o1777)  # no uid reaches it
    left = _folder(top / "left", 0o1777)  # the caller's own (``leave``)
    plain = _folder(top / "plain", 0o777)
    (top / "link").symlink_to(found)  # a link is not a folder of its own
    assert isolation.world_writable_folders({str(left)}, str(top)) == (
        sorted([str(found), str(plain)]),
        None,
    )


def test_the_look_is_bounded_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = _folder(tmp_path / "top", 0o755)
    for n in range(5):
        _folder(top / f"w{n}", 0o777)
    monkeypatch.setattr(isolation, "WRITABLE_MAX", 3)
    found, cut = isolation.world_writable_folders(set(), str(top))
    assert len(found) == 3 and cut == "stopped at 3 folders"
    monkeypatch.setattr(isolation, "WALK_ENTRIES", 2)
    found, cut = isolation.world_writable_folders(set(), str(top))
    assert len(found) == 2 and cut is not None and cut.startswith("stopped after 2 folders")


def test_agents_of_a_host_share_a_look_while_boot_and_mounts_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks: list[set[str]] = []

    def look(leave: set[str], top: str = "/") -> tuple[list[str], str | None]:
        looks.append(leave)
        return ["/run/lock", "/srv/drop"], None

    monkeypatch.setattr(isolation, "world_writable_folders", look)
    kept_in = _folder(tmp_path / "uids", 0o700)
    answer = (["/run/lock", "/srv/drop"], None)
    assert isolation.host_writable_folders(kept_in) == answer
    assert isolation.host_writable_folders(kept_in) == answer
    assert looks == [set(isolation.OWN_TMP)]  # the second agent took the first's answer
    kept = kept_in / "world-writable.json"
    assert kept.stat().st_mode & 0o777 == 0o600
    # Not trusted, so looked at again: a file others may write, one of another key (a
    # reboot, a mount), one gone stale, one that is not the answer's shape.
    told = json.loads(kept.read_text())
    kept.chmod(0o666)
    isolation.host_writable_folders(kept_in)
    assert len(looks) == 2 and kept.stat().st_mode & 0o777 == 0o600
    kept.write_text(json.dumps({**told, "key": "another boot"}))
    isolation.host_writable_folders(kept_in)
    assert len(looks) == 3
    old = kept.stat().st_mtime - isolation.WRITABLE_KEPT_S - 1
    os.utime(kept, (old, old))
    isolation.host_writable_folders(kept_in)
    assert len(looks) == 4
    kept.write_text(json.dumps({**told, "found": ["relative"]}))
    isolation.host_writable_folders(kept_in)
    assert len(looks) == 5
    assert isolation.host_writable_folders(kept_in) == answer and len(looks) == 5


def test_network_fuse_and_kernel_file_systems_are_not_walked(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "30 1 0:40 / /srv/data rw - nfs4 host:/data rw\n"
        "31 1 0:41 / /mnt/my\\040drive rw - fuse.sshfs me@host: rw\n"
        "32 1 0:42 / /mnt/café rw - cifs //host/share rw\n"
        "40 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "41 1 0:50 / /run rw - tmpfs tmpfs rw\n"
        "garbage\n"
    )
    assert isolation._not_walked(str(mountinfo)) == {
        "/proc",
        "/srv/data",
        "/mnt/my drive",
        "/mnt/café",
    }
