"""An attempt's log file on the worker (``services.worker.logfile``), through the executor
with real processes: kept to its last bytes while a task writes as fast as it can, with
core's marker first; read by output position, so the shipper never sees the marker."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from services.worker.executor import AttemptSpec, start_attempt
from services.worker.logfile import AttemptLog

LIMIT = 2**20


def _spec(tmp_path: Path, *argv: str) -> AttemptSpec:
    executable = shutil.which(argv[0])
    assert executable is not None
    return AttemptSpec(
        executable=Path(executable),
        args=argv[1:],
        workdir=tmp_path / "work",
        log_path=tmp_path / "logs" / "1.log",
        task_id=1,
        attempt_id=1,
        attempt_number=1,
        log_max_bytes=LIMIT,
    )


@pytest.mark.skipif(shutil.which("yes") is None, reason="needs yes(1)")
def test_a_flood_is_kept_to_the_bound_while_it_runs_and_ends_with_its_last_bytes(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, "sh", "-c", "timeout 2 yes; echo the-end")

    async def go() -> tuple[int, int, tuple[int, bytes], bytes]:
        running = await start_attempt(spec)
        largest = 0
        while not running.done:
            largest = max(largest, os.stat(spec.log_path).st_size)
            await asyncio.sleep(0.002)
        result = await running.wait()
        assert result.outcome == "succeeded", result
        try:
            return largest, running.log.size(), running.log.read(0, 64), spec.log_path.read_bytes()
        finally:
            running.log.close()

    largest, output, first, kept = asyncio.run(go())

    assert LIMIT < largest <= LIMIT * 5 // 4 + 64 * 1024 + 200
    marker, _, body = kept.partition(b"\n")
    dropped = int(marker.split()[3])
    assert marker == (
        f"[cairn: the first {dropped} bytes of this log were dropped:"
        " an attempt keeps its last 1 MiB]".encode()
    )
    assert LIMIT <= len(body) <= LIMIT * 5 // 4 + 64 * 1024
    assert body.endswith(b"y\ny\nthe-end\n")
    assert output == dropped + len(body) > 10 * LIMIT  # yes wrote far more than is kept
    assert first == (dropped, body[:64])  # positions of the output, never the marker


def test_quiet_output_is_kept_whole_without_a_marker(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "sh", "-c", "echo one; echo two >&2")

    async def go() -> tuple[tuple[int, bytes], int]:
        running = await start_attempt(spec)
        await running.wait()
        try:
            return running.log.read(0, 100), running.log.size()
        finally:
            running.log.close()

    assert asyncio.run(go()) == ((0, b"one\ntwo\n"), 8)
    assert spec.log_path.read_bytes() == b"one\ntwo\n"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("yes") is None, reason="mounts a tmpfs")
def test_a_full_disk_drops_the_output_and_the_task_runs_on(tmp_path: Path) -> None:
    """The log's file system fills (a 256 KiB tmpfs): what the file holds is dropped, it
    starts over after the marker with what came next, and the task never sees an error.
    The task's last line is kept however much the pipe held with it (it was dropped with
    the pipe's bytes once, when the agent read the pipe late under load)."""
    disk = tmp_path / "logs"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    try:
        spec = _spec(tmp_path, "sh", "-c", "timeout 1 yes; test $? = 124 || exit 3; echo the-end")

        async def go() -> str:
            running = await start_attempt(spec)
            result = await running.wait()
            running.log.close()
            return f"{result.outcome} {result.error} {result.log_tail[-300:]!r}"

        outcome = asyncio.run(go())
        assert outcome.startswith("succeeded"), outcome
        kept = spec.log_path.read_bytes()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
    # After the marker, whatever the pipe gave once the disk had room: lines of yes (none when
    # the last drop took yes's last bytes; a drop may end inside a line), then the task's own
    # last line.
    shape = rb"\[cairn: the first \d+ bytes [^\n]*\]\n\n?(y\n)*the-end\n"
    assert re.fullmatch(shape, kept), kept[:100]


def test_a_log_whose_moving_fails_drops_the_rest_and_the_task_runs_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error while moving one log's output: the agent drops the rest of
    that output as it comes. (It stopped reading the pipe: a task that wrote more than a
    pipe holds then waited on its write for ever.)"""
    real_move = AttemptLog._move

    def failing(self: AttemptLog, most: int) -> bool:
        if not self._broken:
            raise RuntimeError("a bug in moving")
        return real_move(self, most)

    monkeypatch.setattr(AttemptLog, "_move", failing)
    spec = _spec(tmp_path, "sh", "-c", "head -c 8000000 /dev/zero; echo the-end")

    async def go() -> str:
        running = await start_attempt(spec)
        result = await asyncio.wait_for(running.wait(), 60)
        running.log.close()
        return str(result.outcome)

    assert asyncio.run(go()) == "succeeded"
    kept = spec.log_path.read_bytes()
    assert re.fullmatch(rb"\[cairn: the first \d+ bytes [^\n]*\]\n", kept), kept[:200]
    assert "keeps no more output" in caplog.text and "a bug in moving" in caplog.text


def test_the_drain_at_the_end_is_done_on_the_spot_unless_a_cut_is_due(tmp_path: Path) -> None:
    """An attempt's end settles its result without a task when its log's rest fits
    (``drained_now``); a rest over the bound is cut first, by ``drained``."""

    async def go(size: int) -> tuple[bool, bytes]:
        log = AttemptLog(tmp_path / f"{size}.log", 4096)
        os.write(log.writer, b"x" * 4000)
        log.pump()  # moved as it came: 4,000 bytes in the file, under the bound
        os.write(log.writer, b"x" * (size - 4) + b"end\n")
        now = log.drained_now()
        if not now:
            await log.drained()
        try:
            return now, log.path.read_bytes()
        finally:
            log.close()

    assert asyncio.run(go(100)) == (True, b"x" * 4096 + b"end\n")
    now, kept = asyncio.run(go(4000))
    assert not now
    marker, _, body = kept.partition(b"\n")
    assert marker.startswith(b"[cairn: the first ") and body.endswith(b"xend\n")
    assert len(body) <= 4096 * 5 // 4
