"""Running one attempt (``services.worker.executor``): real child processes, /bin/sh
scripts written into tmp_path, real signals."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from services.worker import spawner
from services.worker.executor import (
    AttemptResult,
    AttemptSpec,
    run_attempt,
    start_attempt,
)

pytestmark = pytest.mark.slow
T = TypeVar("T")
_starter: dict[str, spawner.Helper | None] = {"helper": None}


@pytest.fixture(autouse=True, params=["fork", "helper"])
def starter(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs twice: attempts forked by the agent (``preexec_fn``), and
    started by the resident spawn helper (``cairn-spawn``)."""
    if request.param == "fork":
        yield "fork"
        return
    binary = spawner.build(spawner.default_folders(Path.home() / ".cairn"))
    if binary is None:
        pytest.skip("no C compiler for the spawn helper")
    helper = spawner.Helper(binary)
    _starter["helper"] = helper
    try:
        yield "helper"
    finally:
        _starter["helper"] = None
        helper.close()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _script(tmp_path: Path, body: str, name: str = "task.sh") -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _spec(tmp_path: Path, executable: Path, *args: str, **overrides: Any) -> AttemptSpec:
    fields: dict[str, Any] = {
        "executable": executable,
        "args": list(args),
        "workdir": tmp_path / "work",
        "log_path": tmp_path / "logs" / "attempt.log",
        "task_id": 41,
        "attempt_id": 7,
        "attempt_number": 2,
        "kill_grace_s": 2.0,
        "helper": _starter["helper"],
    }
    return AttemptSpec(**(fields | overrides))


def _python(tmp_path: Path, code: str, **overrides: Any) -> AttemptSpec:
    return _spec(tmp_path, Path(sys.executable), "-c", code, **overrides)


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the event did not happen in time"
        await asyncio.sleep(0.01)


def _gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for its (other) parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


async def _gone_soon(pid: int) -> bool:
    await _until(lambda: _gone(pid), timeout=5.0)
    return True


def test_exit_0_succeeds(tmp_path: Path) -> None:
    result = _run(run_attempt(_spec(tmp_path, _script(tmp_path, "echo hello\n"))))

    assert (result.outcome, result.exit_code, result.signal, result.error) == (
        "succeeded",
        0,
        None,
        None,
    )
    assert result.log_tail == "hello\n"
    assert result.ended_at >= result.started_at
    assert result.duration_s > 0


def test_exit_3_fails_with_its_exit_code_and_the_log_tail(tmp_path: Path) -> None:
    task = _script(tmp_path, "echo to stdout\necho to stderr >&2\nexit 3\n")

    result = _run(run_attempt(_spec(tmp_path, task)))

    assert (result.outcome, result.exit_code, result.error) == ("failed", 3, "exited 3")
    assert result.log_tail == "to stdout\nto stderr\n"
    assert (tmp_path / "logs" / "attempt.log").read_text() == result.log_tail


def test_the_log_tail_is_the_last_4_kib(tmp_path: Path) -> None:
    code = "import sys; sys.stdout.write('a' * 10000 + 'é' * 3000 + 'END')"

    result = _run(run_attempt(_python(tmp_path, code)))

    assert result.log_tail.endswith("éEND")
    assert 4096 - 3 <= len(result.log_tail.encode()) <= 4096
    assert "\ufffd" not in result.log_tail


def test_child_sees_its_args_verbatim_the_cairn_ids_and_its_workdir_as_cwd(
    tmp_path: Path,
) -> None:
    task = _script(
        tmp_path,
        'printf "%s\\n" "$@" > args.txt\nenv > env.txt\npwd -P > cwd.txt\n',
    )
    args = ["two words", "--flag=$HOME", "", "'quoted' \"too\""]
    spec = _spec(
        tmp_path,
        task,
        *args,
        env={"GREETING": "hi there", "PATH": "/usr/bin:/bin"},
        input_path="/data/in.json",
        output_path="/data/out.json",
    )

    result = _run(run_attempt(spec))

    assert result.outcome == "succeeded"
    work = tmp_path / "work"
    assert (work / "args.txt").read_text().split("\n")[:-1] == args
    assert (work / "cwd.txt").read_text().strip() == str(work.resolve())
    env = dict(line.split("=", 1) for line in (work / "env.txt").read_text().splitlines())
    assert env["CAIRN_TASK_ID"] == "41"
    assert env["CAIRN_ATTEMPT_ID"] == "7"
    assert env["CAIRN_ATTEMPT_NUMBER"] == "2"
    assert env["CAIRN_INPUT_PATH"] == "/data/in.json"
    assert env["CAIRN_OUTPUT_PATH"] == "/data/out.json"
    assert env["GREETING"] == "hi there"
    assert env["PATH"] == "/usr/bin:/bin"
    assert env["HOME"] == str(work)
    assert "VIRTUAL_ENV" not in env and "PYTEST_CURRENT_TEST" not in env


def test_task_env_cannot_override_the_cairn_ids(tmp_path: Path) -> None:
    task = _script(tmp_path, 'test "$CAIRN_ATTEMPT_ID" = 7\n')

    result = _run(run_attempt(_spec(tmp_path, task, env={"CAIRN_ATTEMPT_ID": "999"})))

    assert result.outcome == "succeeded"


def test_an_executable_that_cannot_start_is_a_failed_result(tmp_path: Path) -> None:
    not_a_program = tmp_path / "data.bin"
    not_a_program.write_bytes(b"\x00\x01\x02 no shebang")
    not_a_program.chmod(0o755)

    result = _run(run_attempt(_spec(tmp_path, not_a_program)))

    assert (result.outcome, result.exit_code) == ("failed", None)
    assert result.error is not None and "cannot start" in result.error
    assert "Exec format error" in result.log_tail


def test_timeout_kills_the_whole_process_group_including_a_grandchild(tmp_path: Path) -> None:
    grandchild = tmp_path / "grandchild.pid"
    task = _script(tmp_path, f'sleep 60 &\necho $! > "{grandchild}"\nwait\n')

    result = _run(run_attempt(_spec(tmp_path, task, timeout_s=0.5)))

    assert (result.outcome, result.error, result.stopped) == (
        "timeout",
        "timed out after 0.5 s",
        "timeout",
    )
    assert result.signal == signal.SIGTERM
    assert _run(_gone_soon(int(grandchild.read_text())))


def test_timeout_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    task = _script(tmp_path, "trap '' TERM\nwhile :; do sleep 0.05; done\n")

    result = _run(run_attempt(_spec(tmp_path, task, timeout_s=0.3, kill_grace_s=0.2)))

    assert (result.outcome, result.signal) == ("timeout", signal.SIGKILL)
    assert result.duration_s < 5


def test_terminate_sends_sigterm_first_and_lets_the_task_clean_up(tmp_path: Path) -> None:
    ready, marker = tmp_path / "ready", tmp_path / "got-term"
    task = _script(
        tmp_path,
        f'trap \'echo term > "{marker}"; exit 7\' TERM\ntouch "{ready}"\nsleep 60 &\nwait\n',
    )

    async def scenario() -> AttemptResult:
        running = await start_attempt(_spec(tmp_path, task))
        await _until(ready.exists)
        return await running.terminate(grace_s=5.0)

    result = _run(scenario())

    assert marker.read_text() == "term\n"
    assert (result.outcome, result.exit_code, result.signal) == ("killed", 7, None)
    assert (result.stopped, result.error) == ("terminated", "terminated by the worker")


def test_terminate_kills_after_the_grace_period(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    task = _script(tmp_path, f"trap '' TERM\ntouch \"{ready}\"\nwhile :; do sleep 0.05; done\n")

    async def scenario() -> AttemptResult:
        running = await start_attempt(_spec(tmp_path, task))
        await _until(ready.exists)
        return await running.terminate(grace_s=0.2)

    result = _run(scenario())

    assert (result.outcome, result.signal, result.stopped) == (
        "killed",
        signal.SIGKILL,
        "terminated",
    )


def test_cancelling_run_attempt_kills_the_group_and_reraises(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    task = _script(
        tmp_path, f'sleep 60 &\necho "$$ $!" > "{pids}.tmp"\nmv "{pids}.tmp" "{pids}"\nwait\n'
    )

    async def scenario() -> None:
        attempt = asyncio.create_task(run_attempt(_spec(tmp_path, task)))
        await _until(pids.exists)
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt

    _run(scenario())

    leader, grandchild = (int(pid) for pid in pids.read_text().split())
    assert _gone(leader)
    assert _run(_gone_soon(grandchild))


def test_a_process_killed_from_outside_is_killed_not_stopped(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    task = _script(tmp_path, f'touch "{ready}"\nwhile :; do sleep 0.05; done\n')

    async def scenario() -> AttemptResult:
        running = await start_attempt(_spec(tmp_path, task))
        await _until(ready.exists)
        os.kill(running.pid, signal.SIGKILL)
        return await running.wait()

    result = _run(scenario())

    assert (result.outcome, result.signal, result.stopped) == ("killed", 9, None)
    assert result.error == "killed by signal 9 (SIGKILL)"


def test_cancelling_wait_leaves_the_attempt_running(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    task = _script(tmp_path, f'touch "{ready}"\nsleep 60 &\nwait\n')

    async def scenario() -> tuple[bool, AttemptResult]:
        running = await start_attempt(_spec(tmp_path, task))
        await _until(ready.exists)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(running.wait(), timeout=0.05)
        alive = not _gone(running.pid)
        return alive, await running.terminate(grace_s=5.0)

    alive, result = _run(scenario())

    assert alive
    assert result.outcome == "killed"


def test_memory_limit_makes_a_memory_hog_fail(tmp_path: Path) -> None:
    hog = "data = b'x' * (512 * 1024 * 1024)"

    result = _run(run_attempt(_python(tmp_path, hog, memory_mb=128)))

    assert (result.outcome, result.exit_code) == ("failed", 1)
    assert "MemoryError" in result.log_tail


def test_peak_memory_is_measured(tmp_path: Path) -> None:
    code = "data = b'x' * (80 * 1024 * 1024)"

    result = _run(run_attempt(_python(tmp_path, code, memory_mb=512)))

    assert result.outcome == "succeeded"
    # Linux folds the forking process's resident size at fork into the child's ru_maxrss
    # (the new mm starts with the parent's pages as its high-water mark), so a large
    # pytest worker raises the floor of what any child reports.
    parent_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert result.peak_memory_mb is not None
    assert 80 <= result.peak_memory_mb < max(400, parent_mb + 1)


def test_cpu_seconds_are_measured(tmp_path: Path) -> None:
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"

    result = _run(run_attempt(_python(tmp_path, busy)))

    assert result.outcome == "succeeded"
    assert result.cpu_seconds is not None and result.cpu_seconds > 0.2


def test_many_attempts_at_once_are_each_reaped_with_their_own_result(tmp_path: Path) -> None:
    task = _script(tmp_path, 'exit "$1"\n')

    async def scenario() -> list[AttemptResult]:
        runs: list[Awaitable[AttemptResult]] = [
            run_attempt(
                _spec(tmp_path, task, str(code), log_path=tmp_path / "logs" / f"{code}.log")
            )
            for code in range(20)
        ]
        return list(await asyncio.gather(*runs))

    results = _run(scenario())

    assert [r.exit_code for r in results] == list(range(20))
