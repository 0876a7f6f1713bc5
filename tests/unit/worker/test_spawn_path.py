"""The fast attempt start (``services.worker.spawner`` and ``cgpool``) through the agent's
own ``Host``, as root: the resident helper applies the same sandbox as ``preexec_fn``,
an attempt lands in its cgroup with its limits, and a pooled cgroup never hands a
previous attempt's processes, counters or files to the next one."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from libs.common.models import Artifact, Assignment, Resources
from services.worker import spawner
from services.worker.artifacts import ArtifactCache
from services.worker.executor import AttemptResult, SpawnError, start_attempt
from services.worker.host import Host, Prepared
from services.worker.settings import WorkerSettings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="attempts run as uids of their own as root"),
]

SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()
SECRET = "cairn_token_that_no_attempt_may_see"


def _host(root: Path, fast: bool = True, **settings: Any) -> Host:
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = 29000 + 100 * (index % 9)
    values: dict[str, Any] = {
        "home": root / "home",
        "worker_isolation": "user",
        "worker_run_dir": root / "run",
        "worker_uid_locks": root / "uids",
        "worker_uids": f"{first}-{first + 99}",
        "worker_pids_max": 32,
        "worker_slots": 2,
    } | settings
    host = Host(WorkerSettings(**values), root / "home" / "logs", fast=fast)
    host.start()
    if fast and host.helper is None:
        pytest.skip("no C compiler for the spawn helper")
    return host


def _assignment(
    attempt_id: int,
    script: str,
    memory_mb: int = 64,
    cpu: float = 0.5,
    disk_mb: int | None = None,
) -> Assignment:
    return Assignment(
        attempt_id=attempt_id,
        attempt_number=1,
        task_id=attempt_id,
        kind="task",
        artifact=Artifact(uri=f"file://{SH}", sha256=SH_SHA),
        args=["-c", script],
        env={},
        input_path=None,
        output_path=None,
        resources=Resources(cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb),
        timeout_s=30,
    )


async def _attempt(
    host: Host, attempt_id: int, script: str, memory_mb: int = 64, cpu: float = 0.5
) -> tuple[Prepared, AttemptResult]:
    cache = ArtifactCache(host.settings.home / "artifacts")
    prepared = await host.prepare(_assignment(attempt_id, script, memory_mb, cpu), cache)
    assert prepared.spec.helper is not None  # the fast path, not preexec_fn
    handle = await start_attempt(prepared.spec)
    result = await handle.wait()
    await host.stop_leftovers(prepared)
    return prepared, result


def test_a_hostile_attempt_started_by_the_helper_cannot_read_the_token(root: Path) -> None:
    os.environ["CAIRN_TEST_SECRET"] = SECRET
    try:
        host = _host(root)
        assert host.helper is not None
        helper_pid = host.helper.pid
        token = root / "home" / "token"
        token.write_text(SECRET)
        token.chmod(0o600)
        script = (
            f"cat /proc/{os.getpid()}/environ; echo agent=$?; "
            f"cat /proc/{helper_pid}/environ; echo helper=$?; "
            f"cat {token}; echo file=$?; ls /proc/self/fd | tr '\\n' ' '; echo; env; id -u"
        )

        async def scenario() -> tuple[AttemptResult, bytes]:
            try:
                prepared, result = await _attempt(host, 1, script)
                await host.release(prepared)
                return result, Path(f"/proc/{helper_pid}/environ").read_bytes()
            finally:
                await host.close()

        result, helper_environ = asyncio.run(scenario())
    finally:
        os.environ.pop("CAIRN_TEST_SECRET")
    log = result.log_tail
    assert result.outcome == "succeeded", log
    assert "agent=1" in log and "helper=1" in log and "file=1" in log, log
    assert SECRET not in log, log
    # Only stdin, stdout and stderr reach the task (ls adds its own descriptor for the folder).
    assert "0 1 2 3 \n" in log, log
    assert int(log.strip().splitlines()[-1]) != 0
    assert helper_environ == b""  # the helper was given no environment at all


def test_an_attempt_leads_its_own_group_in_a_session_without_a_terminal(root: Path) -> None:
    """The helper starts each attempt in a process group of its own (what the agent
    signals and kills), in the helper's session, made at its start: no controlling
    terminal there, and the attempt, not its leader, cannot take one."""
    host = _host(root)
    assert host.helper is not None
    script = "cat /proc/$$/stat; echo; if (exec 3</dev/tty) 2>/dev/null; then echo tty; fi"

    async def scenario() -> AttemptResult:
        try:
            prepared, result = await _attempt(host, 1, script)
            await host.release(prepared)
            return result
        finally:
            await host.close()

    result = asyncio.run(scenario())
    log = result.log_tail
    assert result.outcome == "succeeded", log
    pid, _, rest = log.partition(" (")
    group, session, tty = (int(field) for field in rest.rpartition(") ")[2].split()[2:5])
    assert group == int(pid), log  # a group of its own
    assert session not in (0, int(pid), os.getsid(0)), log  # the helper's, not the agent's
    assert tty == 0 and "tty" not in log.splitlines()[-1], log  # none, and none to take


def test_an_attempt_is_born_in_its_pooled_cgroup_with_its_limits(root: Path) -> None:
    host = _host(root)
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")

    async def scenario() -> list[tuple[Prepared, AttemptResult, dict[str, str]]]:
        seen = []
        try:
            for attempt_id, memory_mb in ((1, 64), (2, 96)):
                prepared, result = await _attempt(
                    host, attempt_id, "cat /proc/self/cgroup", memory_mb
                )
                assert prepared.cgroup is not None
                limits = {
                    name: (folder / file).read_text().strip()
                    for name, folder in prepared.cgroup.folders.items()
                    for file in ("memory.limit_in_bytes", "cpu.cfs_quota_us", "pids.max")
                    if (folder / file).exists()
                }
                seen.append((prepared, result, limits))
                await host.release(prepared)
        finally:
            await host.close()
        return seen

    seen = asyncio.run(scenario())
    (first, one, limits_one), (second, _, limits_two) = seen
    assert first.slot is second.slot is not None  # reused, not made again
    assert first.cgroup is not None
    for controller, folder in first.cgroup.folders.items():
        relative = "/" + str(folder.relative_to(Path("/sys/fs/cgroup") / controller)).lstrip("/")
        assert f":{controller}:{relative}\n" in one.log_tail, one.log_tail
    assert limits_one["memory"] == str(64 * 2**20) and limits_two["memory"] == str(96 * 2**20)
    assert limits_one["cpu"] == "50000" and limits_one["pids"] == "33"  # 32 and the helper
    assert not any(folder.exists() for folder in first.cgroup.folders.values())  # closed


def _throttled(folder: Path) -> int:
    for line in (folder / "cpu.stat").read_text().splitlines():
        if line.startswith("nr_throttled "):
            return int(line.split()[1])
    raise AssertionError("no nr_throttled in cpu.stat")


def test_a_small_cpu_request_starts_unthrottled_with_the_same_share(root: Path) -> None:
    """0.01 CPU is 10 ms a second, not 1 ms per 100 ms: the same share, but a shell's
    start-up (and its exec of a command) fits one period instead of being throttled."""
    host = _host(root)
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")

    async def scenario() -> list[tuple[str, str, int, AttemptResult]]:
        seen = []
        try:
            for attempt_id, cpu in ((1, 0.01), (2, 0.5)):
                cache = ArtifactCache(host.settings.home / "artifacts")
                prepared = await host.prepare(
                    _assignment(attempt_id, "cat /proc/self/cgroup", cpu=cpu), cache
                )
                assert prepared.cgroup is not None and prepared.slot is not None
                folder = prepared.cgroup.folders["cpu"]
                before = _throttled(folder)
                handle = await start_attempt(prepared.spec)
                result = await handle.wait()
                period = (folder / "cpu.cfs_period_us").read_text().strip()
                quota = (folder / "cpu.cfs_quota_us").read_text().strip()
                seen.append((period, quota, _throttled(folder) - before, result))
                await host.stop_leftovers(prepared)
                await host.release(prepared)
        finally:
            await host.close()
        return seen

    (period_one, quota_one, throttled, one), (period_two, quota_two, _, two) = asyncio.run(
        scenario()
    )
    assert one.outcome == two.outcome == "succeeded", (one, two)
    assert (period_one, quota_one) == ("1000000", "10000")
    assert throttled == 0
    assert (period_two, quota_two) == ("100000", "50000")  # the same slot, reset


def test_the_start_runs_on_the_slots_budget_and_the_task_on_its_own_quota(root: Path) -> None:
    """The start's own work (the helper's clone, the child's namespaces, keyrings and
    identity) is not charged to the attempt's quota: before the start the slot holds a
    period's worth of every CPU, and the helper writes the attempt's quota once it has
    exec'd, so the task reads its own (10 ms a second at 0.01 CPU) once the helper has run
    again: at once on an idle host, within a scheduler slice on a busy one (the task polls
    for it for up to 30 seconds: a loaded CI host once kept the helper off a CPU for
    longer than 100,000 reads took)."""
    host = _host(root)
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")

    async def scenario() -> tuple[str, str, AttemptResult]:
        try:
            cache = ArtifactCache(host.settings.home / "artifacts")
            prepared = await host.prepare(_assignment(1, "true", cpu=0.01), cache)
            assert prepared.cgroup is not None and prepared.slot is not None
            assert prepared.slot.helper.sets_quota
            quota_file = prepared.cgroup.folders["cpu"] / "cpu.cfs_quota_us"
            before = quota_file.read_text().strip()
            # /bin/sh is dash here: no $SECONDS (the test read it as an error and stopped
            # at its first look on a loaded CI host); the clock is /bin/date's
            poll = (
                "end=$(($(/bin/date +%s) + 30)); "
                f'while read -r q < {quota_file}; [ "$q" != 10000 ]'
                ' && [ "$(/bin/date +%s)" -lt "$end" ]; do :; done; echo "$q"'
            )
            prepared.spec = dataclasses.replace(prepared.spec, args=["-c", poll])
            handle = await start_attempt(prepared.spec)
            result = await handle.wait()
            after = quota_file.read_text().strip()
            await host.stop_leftovers(prepared)
            await host.release(prepared)
            return before, after, result
        finally:
            await host.close()

    before, after, result = asyncio.run(scenario())
    assert result.outcome == "succeeded", result
    assert before == str(1_000_000 * (os.cpu_count() or 1))
    assert result.log_tail.strip() == "10000" and after == "10000"


def test_under_an_agent_with_a_cpu_quota_of_its_own_the_attempts_still_start(
    root: Path,
) -> None:
    """cgroup v1 refuses a slot a quota above its parent's: under an agent whose own
    cgroup holds one CPU, the start's budget (a period of every CPU) cannot be written,
    and the slot holds the attempt's own quota before the start, as without it."""
    host = _host(root)
    if host.slots is None or host.cgroups is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the start's budget is one CPU's too")
    parent = host.cgroups.bases["cpu"]
    (parent / "cpu.cfs_period_us").write_text("100000")
    (parent / "cpu.cfs_quota_us").write_text("100000")

    async def scenario() -> list[tuple[str, AttemptResult]]:
        seen = []
        try:
            for attempt_id in (1, 2):
                cache = ArtifactCache(host.settings.home / "artifacts")
                prepared = await host.prepare(_assignment(attempt_id, "true", cpu=0.5), cache)
                assert prepared.cgroup is not None
                before = (prepared.cgroup.folders["cpu"] / "cpu.cfs_quota_us").read_text()
                handle = await start_attempt(prepared.spec)
                seen.append((before.strip(), await handle.wait()))
                await host.stop_leftovers(prepared)
                await host.release(prepared)
        finally:
            (parent / "cpu.cfs_quota_us").write_text("-1")
            await host.close()
        return seen

    seen = asyncio.run(scenario())
    assert [(before, result.outcome) for before, result in seen] == [
        ("50000", "succeeded"),
        ("50000", "succeeded"),
    ], seen
    assert host.slots is not None and not host.slots.start_budget


def test_a_quota_the_kernel_refuses_kills_the_attempt_before_it_runs(root: Path) -> None:
    """The helper cannot write the attempt's quota (below the kernel's 1 ms): the start
    fails at its step, the process is killed and reaped, and nothing of it ran on."""
    host = _host(root)
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")
    mark = root / "ran"

    async def scenario() -> tuple[SpawnError, list[int]]:
        try:
            cache = ArtifactCache(host.settings.home / "artifacts")
            script = f"sleep 0.3; echo ran > {mark}"
            prepared = await host.prepare(_assignment(1, script, cpu=0.5), cache)
            assert prepared.cgroup is not None
            prepared.cgroup.quota_at_exec = "5"
            with pytest.raises(SpawnError) as failed:
                await start_attempt(prepared.spec)
            await asyncio.sleep(0.5)
            left = prepared.cgroup.pids()
            await host.release(prepared)
            return failed.value, left
        finally:
            await host.close()

    root.chmod(0o777)  # the attempt's uid could write the mark, had it run
    failure, left = asyncio.run(scenario())
    assert "CPU quota" in str(failure) and "Invalid argument" in str(failure), failure
    assert left == [] and not mark.exists()


def test_the_pool_hands_no_process_file_or_counter_to_the_next_attempt(root: Path) -> None:
    host = _host(root)
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")
    hog = "python3 -c \"b = bytearray(48 * 2**20); b[::4096] = b'x' * len(b[::4096])\""
    first_script = (
        f"{hog}; echo left > /tmp/left-behind; setsid sleep 300 & echo $! > $HOME/pid; "
        "python3 -c 'import time; time.sleep(0.2)'"
    )
    second_script = "ls /tmp; cat /proc/self/cgroup >/dev/null; echo second"

    async def scenario() -> tuple[Prepared, AttemptResult, Prepared, AttemptResult, int]:
        try:
            first, one = await _attempt(host, 1, first_script, memory_mb=128)
            stray = int((first.folders.view / "pid").read_text())
            await host.release(first)
            second, two = await _attempt(host, 2, second_script, memory_mb=128)
            assert second.slot is first.slot
            await host.release(second)
            return first, one, second, two, stray
        finally:
            await host.close()

    _, one, _, two, stray = asyncio.run(scenario())
    assert one.outcome == two.outcome == "succeeded", (one, two)
    assert one.peak_memory_mb is not None and one.peak_memory_mb >= 48
    assert two.peak_memory_mb is not None and two.peak_memory_mb < 24, two
    assert two.cpu_seconds is not None and two.cpu_seconds < (one.cpu_seconds or 0)
    assert "left-behind" not in two.log_tail and "second" in two.log_tail
    assert _gone(stray)


def test_the_uid_is_cleaned_up_by_the_helper_without_a_cgroup(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.worker import cgroups
    from services.worker import host as host_module

    monkeypatch.setattr(
        cgroups.Cgroups, "detect", classmethod(lambda cls, devices=False: (None, "off"))
    )
    monkeypatch.setattr(
        host_module, "kill_every_process_of", lambda identity: pytest.fail("spawned a shell")
    )
    host = _host(root)
    assert host.slots is None and host.cgroups is None
    script = "setsid sleep 300 & echo $! > $HOME/pid"

    async def scenario() -> int:
        try:
            prepared, result = await _attempt(host, 1, script)
            assert result.outcome == "succeeded"
            stray = int((prepared.folders.view / "pid").read_text())
            await host.release(prepared)
            return stray
        finally:
            await host.close()

    stray = asyncio.run(scenario())
    assert _gone(stray)


def _v2_folder(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    """A writable cgroup2 mount, the spawn helper built, and a new folder ``name-PID``
    beside this process's own cgroup (skips where either is missing)."""
    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip("no writable cgroup2 mount")
    binary = spawner.build(spawner.default_folders(tmp_path))
    if binary is None:
        pytest.skip("no C compiler for the spawn helper")
    own = Path("/proc/self/cgroup").read_text().split("0::", 1)[1].split("\n")[0]
    folder = mount / own.lstrip("/") / f"{name}-{os.getpid()}"
    folder.mkdir()
    return mount, binary, folder


def test_v2_clone_into_cgroup_places_the_child_at_birth(tmp_path: Path) -> None:
    """cgroup v2 with no controllers still shows where a process is: the helper's
    ``CLONE_INTO_CGROUP`` puts the child into the folder it is given."""
    mount, binary, folder = _v2_folder(tmp_path, "cairn-test")
    log_path = tmp_path / "log"

    async def scenario() -> int:
        helper = spawner.Helper(binary)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o600)
        into = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            launch = spawner.Launch("/bin/cat", ["cat", "/proc/self/cgroup"], {}, str(tmp_path))
            _, exited = await helper.spawn(launch, log, into)
            status, _ = await exited  # the helper's child, reaped by it
            return status
        finally:
            os.close(log)
            os.close(into)
            helper.close()

    try:
        assert asyncio.run(scenario()) == 0
    finally:
        folder.rmdir()
    relative = "/" + str(folder.relative_to(mount))
    assert f"0::{relative}\n" in log_path.read_text()


def test_v2_the_quota_goes_to_the_given_folder_and_a_start_without_it_never_runs(
    tmp_path: Path,
) -> None:
    """On cgroup v2 the helper writes the attempt's quota to ``cpu.max`` of the folder it
    starts the child into. Here no controller is enabled, so that file is missing: the
    start fails at step "CPU quota", its child killed and reaped before it got on, and
    the folder is left empty. (The write that succeeds needs a cgroup2 with the cpu
    controller; v1's is in ``test_the_start_runs_on_the_slots_budget_...``.)"""
    _, binary, folder = _v2_folder(tmp_path, "cairn-test-quota")
    mark = tmp_path / "ran"

    async def scenario() -> spawner.SpawnFailed:
        helper = spawner.Helper(binary)
        log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT, 0o600)
        into = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            script = f"sleep 0.3; echo ran > {mark}"
            launch = spawner.Launch(
                "/bin/sh", ["sh", "-c", script], {}, str(tmp_path), cpu_quota="10000 1000000"
            )
            with pytest.raises(spawner.SpawnFailed) as failed:
                await helper.spawn(launch, log, into)
            await asyncio.sleep(0.5)
            return failed.value
        finally:
            os.close(log)
            os.close(into)
            helper.close()

    try:
        failure = asyncio.run(scenario())
        assert (folder / "cgroup.procs").read_text() == ""
    finally:
        folder.rmdir()
    assert failure.step == 14 and "CPU quota" in str(failure) and "No such file" in str(failure)
    assert not mark.exists()
    with pytest.raises(ChildProcessError):
        os.waitpid(failure.pid, os.WNOHANG)  # reaped by the helper


def test_a_quota_is_numbers_only() -> None:
    for bad in ("max", "10000 max", "-1", "1 2 3", "10000\n", ""):
        launch = spawner.Launch("/bin/true", ["true"], {}, "/", cpu_quota=bad)
        with pytest.raises(ValueError, match="not a CPU quota"):
            launch.encode(False)
    assert b"\x00q10000 100000\x00" in spawner.Launch(
        "/bin/true", ["true"], {}, "/", cpu_quota="10000 100000"
    ).encode(True)


def test_a_child_that_cannot_exec_is_reported_and_reaped(tmp_path: Path) -> None:
    binary = spawner.build(spawner.default_folders(tmp_path))
    if binary is None:
        pytest.skip("no C compiler for the spawn helper")

    async def scenario() -> spawner.SpawnFailed:
        helper = spawner.Helper(binary)
        log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            launch = spawner.Launch(str(tmp_path / "missing"), ["missing"], {}, str(tmp_path))
            with pytest.raises(spawner.SpawnFailed) as failed:
                await helper.spawn(launch, log)
            return failed.value
        finally:
            os.close(log)
            helper.close()

    failure = asyncio.run(scenario())
    assert failure.step == spawner.EXEC_STEP and "No such file" in str(failure)
    with pytest.raises(ChildProcessError):
        os.waitpid(failure.pid, os.WNOHANG)  # already reaped


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """The process dies: no such process, or only a zombie waiting for its new parent.
    (On a loaded machine a killed process may wait a while for the CPU to die on.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat.rpartition(")")[2].split()[0] == "Z":
            return True
        time.sleep(0.01)
    return False


def _cgroup2_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.startswith("cgroup2 "):
            point = Path(left.split(" ")[4])
            return point if os.access(point, os.W_OK) else None
    return None


def test_a_helper_killed_between_attempts_is_replaced(root: Path) -> None:
    host = _host(root)

    async def scenario() -> tuple[AttemptResult, int, int]:
        try:
            first, _ = await _attempt(host, 1, "true")
            await host.release(first)
            killed = first.slot.helper.pid if first.slot else host.helper.pid  # type: ignore[union-attr]
            os.kill(killed, 9)  # as the sidecar does to a cut-off worker's cgroups
            await asyncio.sleep(0.05)
            second, result = await _attempt(host, 2, "echo still-works")
            await host.release(second)
            started_by = second.slot.helper.pid if second.slot else host.helper.pid  # type: ignore[union-attr]
            return result, killed, started_by
        finally:
            await host.close()

    result, killed, started_by = asyncio.run(scenario())
    assert result.outcome == "succeeded" and "still-works" in result.log_tail
    assert started_by != killed


def test_the_helper_reports_exits_and_delivers_stops(root: Path) -> None:
    """The helper is the attempts' parent: their exit code, signal and timeout come from
    its exit records, and a stop reaches the process group through it."""
    host = _host(root)

    async def run(attempt_id: int, script: str, timeout_s: float | None) -> AttemptResult:
        cache = ArtifactCache(host.settings.home / "artifacts")
        assignment = _assignment(attempt_id, script).model_copy(update={"timeout_s": timeout_s})
        prepared = await host.prepare(assignment, cache)
        try:
            handle = await start_attempt(prepared.spec)
            if timeout_s is not None:  # still running: the helper's child, not ours
                helper = prepared.slot.helper if prepared.slot else host.helper
                assert helper is not None and _parent_of(handle.pid) == helper.pid
            result = await handle.wait()
            await host.stop_leftovers(prepared)
            return result
        finally:
            await host.release(prepared)

    async def scenario() -> list[AttemptResult]:
        try:
            return [
                await run(1, "exit 3", None),
                await run(2, "kill -9 $$", None),
                await run(3, "trap '' TERM; sleep 30 & wait", 0.3),
            ]
        finally:
            await host.close()

    exited, killed, timed_out = asyncio.run(scenario())
    assert (exited.outcome, exited.exit_code, exited.error) == ("failed", 3, "exited 3")
    assert (killed.outcome, killed.signal) == ("killed", 9)
    assert timed_out.outcome == "timeout" and timed_out.signal == 9  # SIGTERM ignored
    assert exited.cpu_seconds is not None and exited.peak_memory_mb


def test_an_attempt_whose_helper_dies_is_stopped_and_failed(root: Path) -> None:
    """Its exit status dies with its parent: it is stopped, and fails saying why."""
    host = _host(root)

    async def scenario() -> tuple[AttemptResult, int]:
        cache = ArtifactCache(host.settings.home / "artifacts")
        prepared = await host.prepare(_assignment(1, "sleep 30"), cache)
        try:
            handle = await start_attempt(prepared.spec)
            helper = prepared.slot.helper if prepared.slot else host.helper
            assert helper is not None
            os.kill(helper.pid, 9)
            result = await asyncio.wait_for(handle.wait(), 10)
            await host.stop_leftovers(prepared)
            return result, handle.pid
        finally:
            await host.release(prepared)
            await host.close()

    result, pid = asyncio.run(scenario())
    assert result.outcome == "failed" and "spawn helper" in (result.error or "")
    assert _gone(pid)


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
