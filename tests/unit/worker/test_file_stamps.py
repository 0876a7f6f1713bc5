"""``file://`` artifacts verified once per unchanged file (``artifacts.FileStamps``), as
root: a source is hashed again after any change of its bytes (in place with its size and
mtime put back, or by a rename), never while something may write it unseen, and opened as
the attempt at every start whatever is remembered."""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from services.worker.artifacts import (
    ArtifactCache,
    ArtifactError,
    FileStamps,
    Sealed,
    open_as_here,
)
from services.worker.isolation import Identity

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sources are opened as a uid")

READER = Identity(29994, 29994)
SCRIPT = b"#!/bin/sh\necho stamped\n"
OTHER = b"#!/bin/sh\necho changed\n"
DIGEST = hashlib.sha256(SCRIPT).hexdigest()
QUIET_S = 0.05


@pytest.fixture
def cache(root: Path) -> ArtifactCache:
    made = ArtifactCache(root / "cache")
    made.stamps = FileStamps(quiet_ns=int(QUIET_S * 1e9))
    return made


@pytest.fixture
def sealed(root: Path) -> Sealed:
    (root / "sealed").mkdir(mode=0o700)
    return Sealed(root / "sealed", 2**20)


def _write(path: Path, body: bytes = SCRIPT) -> Path:
    path.write_bytes(body)
    path.chmod(0o644)
    time.sleep(QUIET_S * 2)  # its last change old enough to be remembered
    return path


def _stamp(path: Path) -> tuple[int, int, int, int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _seal(cache: ArtifactCache, source: Path, sealed: Sealed) -> Path:
    return cache.seal_local(source.as_uri(), DIGEST, READER, sealed)


def test_a_settled_source_is_hashed_once_then_taken_while_its_stamp_holds(
    cache: ArtifactCache, sealed: Sealed, root: Path
) -> None:
    source = _write(root / "tool.sh")
    copy = _seal(cache, source, sealed)
    assert cache.stamps.holds(_stamp(source), DIGEST)
    assert not cache.stamps.holds(_stamp(source), hashlib.sha256(OTHER).hexdigest())
    again = _seal(cache, source, sealed)
    assert again == copy and again.stat().st_ino == copy.stat().st_ino
    assert again.read_bytes() == SCRIPT


def test_a_source_rewritten_in_place_with_its_size_and_mtime_put_back_is_hashed_again(
    cache: ArtifactCache, sealed: Sealed, root: Path
) -> None:
    source = _write(root / "tool.sh")
    copy = _seal(cache, source, sealed)
    before = source.stat()
    with source.open("r+b") as f:
        f.write(OTHER)
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = source.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        _seal(cache, source, sealed)
    assert copy.read_bytes() == SCRIPT  # the sealed copy is never the changed bytes
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        _seal(cache, source, sealed)  # no stamp of the changed file was remembered
    _write(source)
    assert _seal(cache, source, sealed).read_bytes() == SCRIPT


def test_a_source_replaced_by_a_rename_is_hashed_again(
    cache: ArtifactCache, sealed: Sealed, root: Path
) -> None:
    source = _write(root / "tool.sh")
    _seal(cache, source, sealed)
    before = source.stat()
    other = _write(root / "other.sh", OTHER)
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(other, source)
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        _seal(cache, source, sealed)


def test_a_remembered_source_is_still_opened_as_the_attempt_at_every_start(
    cache: ArtifactCache, sealed: Sealed, root: Path
) -> None:
    source = _write(root / "tool.sh")
    _seal(cache, source, sealed)
    source.chmod(0o600)  # root's alone now: what was remembered does not stand in for it
    with pytest.raises(ArtifactError, match="not readable by the attempt"):
        _seal(cache, source, sealed)
    source.chmod(0o644)
    assert _seal(cache, source, sealed).read_bytes() == SCRIPT


def test_a_fresh_source_or_one_open_for_writing_is_hashed_at_every_start(
    cache: ArtifactCache, sealed: Sealed, root: Path
) -> None:
    source = root / "tool.sh"
    source.write_bytes(SCRIPT)
    source.chmod(0o644)
    cache.stamps.quiet_ns = 10**12  # its change is recent: a later one could share its time
    _seal(cache, source, sealed)
    assert not cache.stamps.holds(_stamp(source), DIGEST)
    cache.stamps.quiet_ns = int(QUIET_S * 1e9)
    time.sleep(QUIET_S * 2)
    fd = os.open(source, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, len(SCRIPT))
        mapped[-2:-1] = b"d"  # a dirty shared page: later writes to it move no timestamp
        time.sleep(QUIET_S * 2)
        mapped[-2:-1] = b"d"
        _seal(cache, source, sealed)
        assert not cache.stamps.holds(_stamp(source), DIGEST)  # a writer holds it open
        mapped[-2:-1] = b"X"
        with pytest.raises(ArtifactError, match="sha256 mismatch"):
            _seal(cache, source, sealed)
        mapped.close()
    finally:
        os.close(fd)
    _write(source)
    _seal(cache, source, sealed)
    assert cache.stamps.holds(_stamp(source), DIGEST)


def _known_here(cache: ArtifactCache, source: Path, sealed: Sealed) -> Path | BaseException | None:
    """``sealed_known`` on a thread of its own, as the agent's loop calls it
    (``open_as_here``: that thread's groups are dropped, not the test's)."""
    got: list[Path | BaseException | None] = []

    def run() -> None:
        open_as_here()
        try:
            got.append(cache.sealed_known(source.as_uri(), DIGEST, READER, sealed))
        except BaseException as exc:  # the test asserts on it
            got.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return got[0]


def test_the_loops_look_takes_only_a_remembered_source_opened_as_the_attempt(
    cache: ArtifactCache, sealed: Sealed, root: Path
) -> None:
    source = _write(root / "tool.sh")
    assert _known_here(cache, source, sealed) is None  # never sealed: the thread's work
    copy = _seal(cache, source, sealed)
    assert _known_here(cache, source, sealed) == copy
    # Its folder closed to the attempt (the file's own stamp unchanged): refused, as the
    # thread's open refuses it, never opened with root's rights.
    root.chmod(0o700)
    refused = _known_here(cache, source, sealed)
    assert isinstance(refused, ArtifactError) and "not readable by the attempt" in str(refused)
    root.chmod(0o711)
    assert _known_here(cache, source, sealed) == copy
    _write(source, OTHER)  # changed: nothing read on the loop, hashed again in a thread
    assert _known_here(cache, source, sealed) is None
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        _seal(cache, source, sealed)
    assert _known_here(cache, source, sealed) is None


def test_file_stamps_keep_to_their_bound_and_forget_a_changed_file() -> None:
    stamps = FileStamps(quiet_ns=0, max_entries=2)
    first, second, third = ((1, n, 10, 5, 5) for n in (1, 2, 3))
    for stamp in (first, second, third):
        stamps.remember(stamp, DIGEST)
    assert not stamps.holds(first, DIGEST)
    assert stamps.holds(second, DIGEST) and stamps.holds(third, DIGEST)
    changed = (1, 2, 10, 5, 6)
    assert not stamps.holds(changed, DIGEST)
    assert not stamps.holds(second, DIGEST)  # forgotten, not kept beside the new stamp
