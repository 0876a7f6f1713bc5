"""An attempt's home and /tmp on a tmpfs of its own (``services.worker.tmpfs``), through
the agent's own ``Host``, as root, by the spawn helper and by ``preexec_fn``: sized by its
disk quota, read back after it ended, nothing left on disk; a write past the quota fails
with ENOSPC and the attempt ends ``disk_exceeded``; its pages count towards its memory."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pytest

from libs.common.models import Artifact
from services.worker import outputs
from services.worker.artifacts import ArtifactCache, ArtifactError
from services.worker.executor import AttemptResult, start_attempt
from services.worker.host import Host
from tests.unit.worker.test_spawn_path import _assignment
from tests.unit.worker.test_spawn_path import _host as _spawn_host

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="attempts run as uids of their own as root"),
]


def _host(root: Path, fast: bool = True, **settings: Any) -> Host:
    host = _spawn_host(root, fast, **{"worker_disk_mb": 8, **settings})
    if not host.tmpfs:
        pytest.skip("no private tmpfs on this host (mount namespaces or the mount API)")
    return host


def _run(
    host: Host, script: str, memory_mb: int = 64, disk_mb: int | None = None
) -> tuple[AttemptResult, Any]:
    """Run one attempt; its result and its outputs (read after it ended, as the agent
    does), then release it."""

    async def scenario() -> tuple[AttemptResult, Any]:
        try:
            cache = ArtifactCache(host.settings.home / "artifacts")
            assignment = _assignment(1, script, memory_mb, disk_mb=disk_mb)
            prepared = await host.prepare(assignment, cache)
            assert prepared.folders.mount is not None
            handle = await start_attempt(prepared.spec)
            result = await handle.wait()
            handle.log.close()
            await host.stop_leftovers(prepared)
            found = outputs.read(prepared.folders.view)
            await host.release(prepared)
            assert prepared.folders.mount is None  # let go
            return result, found
        finally:
            await host.close()

    return asyncio.run(scenario())


@pytest.mark.parametrize("fast", [True, False], ids=["helper", "preexec_fn"])
def test_home_and_tmp_are_a_tmpfs_of_the_quota_read_back_after_the_end(
    root: Path, fast: bool
) -> None:
    host = _host(root, fast=fast)
    script = (
        'stat -f -c "fs %T" "$HOME"; stat -c "home %a %u" "$HOME"; pwd; '
        'df -k /tmp | tail -1; echo x > /tmp/mine; ls "$HOME/tmp"; '
        'echo \'{"answer": 42}\' > "$CAIRN_OUTPUTS"'
    )
    result, found = _run(host, script, disk_mb=3)

    log = result.log_tail
    assert result.outcome == "succeeded", log
    owner = re.search(r"home 700 (\d+)", log)
    assert "fs tmpfs" in log and owner and int(owner.group(1)) in host.settings.uids, log
    assert f"{host.workdirs.mount_point}\n" in log, log  # its working folder
    assert " 3072 " in log, log  # /tmp is the same 3 MB tmpfs
    assert "mine" in log, log
    assert found == {"answer": 42}
    # Nothing of it on disk: no folder made, nothing to remove.
    assert not (host.run_dir / "1").exists()
    assert list(host.workdirs.mount_point.iterdir()) == []


def test_a_write_past_the_quota_fails_with_enospc_and_ends_disk_exceeded(root: Path) -> None:
    host = _host(root)
    script = "dd if=/dev/zero of=/tmp/big bs=1M count=16 status=none || exit 3"
    result, _ = _run(host, script, disk_mb=2)

    assert result.outcome == "disk_exceeded", result
    assert "No space left on device" in result.log_tail, result.log_tail
    assert result.error is not None and "2 MB" in result.error and "ENOSPC" in result.error


def test_a_full_tmpfs_with_a_success_is_a_success(root: Path) -> None:
    host = _host(root, worker_disk_mb=16)  # its default quota; over 8 MB: let go in a thread
    result, _ = _run(host, "dd if=/dev/zero of=big bs=1M count=24 status=none; true")

    assert result.outcome == "succeeded", result


def test_its_pages_count_towards_its_memory_limit(root: Path) -> None:
    host = _host(root)
    if host.cgroups is None or "memory" not in host.cgroups.enforced:
        pytest.skip("no memory cgroup here")
    script = "dd if=/dev/zero of=big bs=1M count=96 status=none; echo wrote=$?"
    result, _ = _run(host, script, memory_mb=32, disk_mb=128)

    # 96 MB of files do not fit in 32 MB of memory: the kernel kills the writer.
    assert result.outcome == "oom_killed", result
    assert "wrote=0" not in result.log_tail


def test_its_sealed_executable_is_bound_on_a_placeholder_in_its_namespace_only(
    root: Path,
) -> None:
    host = _host(root)
    script = (
        'echo "zero=$0"; cmp "$0" /bin/sh && echo same; '
        'echo pwned > "$0"; echo write=$?; chmod 777 "$0"; echo chmod=$?'
    )
    result, _ = _run(host, script)

    log = result.log_tail
    placeholder = host.workdirs.bin_root / "sh"
    assert result.outcome == "succeeded", log
    assert f"zero={placeholder}\n" in log and "same" in log, log
    assert "write=0" not in log and "chmod=0" not in log, log
    # Outside its namespace: the agent's empty placeholder, and no executable folder.
    info = placeholder.lstat()
    assert (info.st_uid, info.st_size, info.st_mode & 0o7777) == (0, 0, 0o444)
    assert list(host.workdirs.exe_root.iterdir()) == []


def test_its_file_source_is_checked_by_the_helpers_child_and_sealed_again_when_it_changed(
    root: Path,
) -> None:
    """A ``file://`` source whose stamp is remembered is opened as the attempt by its
    spawn helper's child, not by the agent; changed, it is hashed again before anything
    runs (same bytes: it runs, with nothing of the failed check in its log; other bytes
    or unreadable: refused)."""
    host = _host(root)
    source = root / "job.sh"
    v1, v2 = b"#!/bin/sh\necho v1\n", b"#!/bin/sh\necho v2\n"
    source.write_bytes(v1)
    source.chmod(0o755)
    digest = hashlib.sha256(v1).hexdigest()

    async def attempt(cache: ArtifactCache, attempt_id: int) -> tuple[str, str | Exception]:
        """How its source was checked (``agent``: opened and hashed or stamped by the
        agent; ``child``: by the helper's child; ``again``: the child's check failed and
        the agent sealed it again), and its log or why it was refused."""
        assignment = _assignment(attempt_id, "")
        assignment = assignment.model_copy(
            update={"artifact": Artifact(uri=source.as_uri(), sha256=digest), "args": []}
        )
        prepared = await host.prepare(assignment, cache)
        checked = prepared.folders.source_check is not None
        try:
            handle = await host.launch(prepared, cache)
        except ArtifactError as exc:
            await host.release(prepared)
            return "again", exc
        result = await handle.wait()
        handle.log.close()
        await host.stop_leftovers(prepared)
        await host.release(prepared)
        assert result.outcome == "succeeded", result
        how = "agent" if not checked else "child" if prepared.local else "again"
        return how, result.log_tail

    async def scenario() -> list[tuple[str, str | Exception]]:
        cache = ArtifactCache(host.settings.home / "artifacts")
        cache.stamps.quiet_ns = 0  # its stamp remembered at once (no 2 s wait)
        try:
            seen = [await attempt(cache, 1), await attempt(cache, 2)]
            source.write_bytes(v1)  # the same bytes again: a new stamp
            seen.append(await attempt(cache, 3))
            source.write_bytes(v2)
            seen.append(await attempt(cache, 4))
            source.write_bytes(v1)
            seen.append(await attempt(cache, 5))
            source.chmod(0o700)  # the agent's only: the attempt cannot open it
            seen.append(await attempt(cache, 6))
            return seen
        finally:
            await host.close()

    first, known, touched, changed, back, hidden = asyncio.run(scenario())
    assert first == ("agent", "v1\n")  # hashed by the agent, its stamp remembered
    assert known == ("child", "v1\n")  # checked by the helper's child alone
    assert touched == ("again", "v1\n")  # the check failed, hashed again, run; a clean log
    assert changed[0] == "again" and isinstance(changed[1], ArtifactError), changed
    assert "sha256" in str(changed[1]) or "digest" in str(changed[1]), changed
    assert back == ("agent", "v1\n")
    assert hidden[0] == "again" and isinstance(hidden[1], ArtifactError), hidden
    assert "not readable by the attempt" in str(hidden[1]), hidden


def test_a_prepared_attempts_sealed_copy_outlives_the_caches_eviction_until_it_starts(
    root: Path,
) -> None:
    """A bound executable names its sealed copy by path until its start binds it (no link
    holds it meanwhile): another attempt's seal that evicts the cache's oldest copies in
    between leaves it in place, and it starts; once given back, the cache is trimmed."""
    host = _host(root)  # the spawn helper binds the copy (a fork of the agent: a link)
    other = root / "other.sh"
    other.write_bytes(b"#!/bin/sh\necho other\n")
    other.chmod(0o755)
    second = Artifact(uri=other.as_uri(), sha256=hashlib.sha256(other.read_bytes()).hexdigest())

    async def scenario() -> tuple[AttemptResult, bool, bool]:
        try:
            cache = ArtifactCache(host.settings.home / "artifacts")
            first = await host.prepare(_assignment(1, "echo ran"), cache)
            bound = first.folders.bound
            assert bound is not None and first.folders.placeholder
            assert host.sealed is not None
            host.sealed.max_bytes = 1  # every copy but the newest one is over the bound
            assignment = _assignment(2, "").model_copy(update={"artifact": second, "args": []})
            later = await host.prepare(assignment, cache)  # sealed after: the newest
            kept = bound.exists()
            handle = await host.launch(first, cache)
            result = await handle.wait()
            handle.log.close()
            await host.stop_leftovers(first)
            await host.release(first)
            await host.release(later)
            return result, kept, bound.exists()
        finally:
            await host.close()

    result, kept, after = asyncio.run(scenario())
    assert kept, "the sealed copy of a prepared attempt was evicted before it started"
    assert result.outcome == "succeeded" and "ran" in result.log_tail, result
    assert not after  # given back: the cache trims what it held over its bound


def test_a_sealed_copy_evicted_between_its_look_up_and_its_hold_is_sealed_again(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's seal may evict a copy the fast path just found: its hold fails,
    and the attempt is prepared as if none were known (sealed again), not handed back."""
    host = _host(root)
    assert host.sealed is not None
    sealed = host.sealed
    hold = sealed.hold
    evicted: list[str] = []

    def evicted_first(path: Path) -> Any:
        if not evicted:  # as another thread's seal would, between look-up and hold
            evicted.append(path.name)
            sealed._known.pop(path.name)
        return hold(path)

    async def scenario() -> tuple[AttemptResult, bool]:
        try:
            cache = ArtifactCache(host.settings.home / "artifacts")
            cache.stamps.quiet_ns = 0  # its stamp remembered at once: the fast path next
            first = await host.prepare(_assignment(1, ""), cache)
            await host.release(first)
            monkeypatch.setattr(sealed, "hold", evicted_first)
            again = await host.prepare(_assignment(2, "echo ran"), cache)
            handle = await host.launch(again, cache)
            result = await handle.wait()
            handle.log.close()
            await host.stop_leftovers(again)
            await host.release(again)
            return result, again.folders.source_check is None
        finally:
            await host.close()

    result, slow = asyncio.run(scenario())
    assert evicted and slow  # the look-up found it; prepared by the thread's seal instead
    assert result.outcome == "succeeded" and "ran" in result.log_tail, result
