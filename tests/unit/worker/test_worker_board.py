"""The board the agent shares with its sidecar (``services.worker.state.Board``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from libs.common.models import HeartbeatAnswer
from services.worker.sidecar import Pulse, beat_forever
from services.worker.state import HALF, Board


def test_a_fresh_board_reads_empty_and_then_the_newest_value() -> None:
    board = Board.create()
    try:
        assert board.read() == {}
        for n in range(5):
            board.write({"agent_pid": 7, "attempts": {str(i): i for i in range(n)}})
            assert board.read() == {"agent_pid": 7, "attempts": {str(i): i for i in range(n)}}
    finally:
        board.close()


def test_a_closed_board_writes_nothing_into_the_file_that_took_its_number(tmp_path: Path) -> None:
    """A write after ``close`` (a release ending as the agent exits publishes) is dropped:
    the number its descriptor had names the next file opened."""
    board = Board.create()
    number = board.fd
    board.close()
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert other == number  # the lowest free number: the board's
        board.write({"uids": {"1": 29000}})
        board.close()
        assert os.fstat(other).st_size == 0
    finally:
        os.close(other)


def test_a_half_cut_short_leaves_the_value_before_it() -> None:
    board = Board.create()
    try:
        board.write({"attempts": {"1": 10}})
        board.write({"attempts": {"1": 10, "2": 20}})
        # The newest half torn (its payload half overwritten, as by a death mid-write).
        newest = (2 % 2) * HALF
        os.pwrite(board.fd, b"garbage", newest + 16 + 3)
        assert board.read() == {"attempts": {"1": 10}}
    finally:
        board.close()


def test_another_process_reads_what_was_written_through_the_inherited_descriptor() -> None:
    board = Board.create()
    try:
        board.write({"agent_pid": os.getpid(), "attempts": {"5": -1}})
        code = (
            "import json, sys; from services.worker.state import Board; "
            "print(json.dumps(Board(int(sys.argv[1])).read()))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(board.fd)],
            pass_fds=(board.fd,),
            capture_output=True,
            check=True,
        )
        assert json.loads(out.stdout) == {"agent_pid": os.getpid(), "attempts": {"5": -1}}
    finally:
        board.close()


def test_the_pulse_is_none_until_marked_then_the_last_mark_beside_the_value() -> None:
    board = Board.create()
    try:
        assert board.pulse_at() is None
        board.write({"agent_pid": 7})
        board.pulse(12.5)
        board.pulse(13.25)
        assert board.pulse_at() == 13.25
        assert board.read() == {"agent_pid": 7}
    finally:
        board.close()


def test_a_torn_pulse_reads_as_none_not_as_a_time_long_past() -> None:
    board = Board.create()
    try:
        board.pulse(100.0)
        os.pwrite(board.fd, struct.pack("=d", 1.0), 2 * HALF)  # one copy of two rewritten
        assert board.pulse_at() is None
    finally:
        board.close()


def test_the_sidecar_takes_an_agent_for_hung_past_half_the_bound_only() -> None:
    board = Board.create()
    try:

        def watching_since(seconds: float) -> Pulse:
            pulse = Pulse(board, hang_s=4.0)
            pulse.since -= seconds  # the sidecar started that long ago
            return pulse

        board.pulse(time.monotonic() - 1.9)
        assert watching_since(100).hung() is None
        board.pulse(time.monotonic() - 2.5)
        still = watching_since(100).hung()
        assert still is not None and 2.5 <= still < 3.5
        # No mark yet (or one older than its start): still since the sidecar started.
        assert watching_since(1).hung() is None
        # A torn read keeps the newest mark seen: the loop is not taken for still since.
        pulse = watching_since(100)
        board.pulse(time.monotonic())
        assert pulse.hung() is None
        os.pwrite(board.fd, struct.pack("=d", 1.0), 2 * HALF)
        assert pulse.hung() is None
    finally:
        board.close()


def test_what_hangs_on_sources_is_read_with_the_pulse_and_none_when_torn() -> None:
    board = Board.create()
    try:
        assert board.hung() == (0, 0)
        board.pulse(5.0, (1, 8))
        assert (board.pulse_at(), board.hung()) == (5.0, (1, 8))
        board.pulse(6.0)
        assert board.hung() == (0, 0)
        board.pulse(7.0, (2, 0))
        os.pwrite(board.fd, struct.pack("=d", 1.0), 2 * HALF)  # torn
        assert (board.pulse_at(), board.hung()) == (None, (0, 0))
    finally:
        board.close()


def test_a_beat_carries_the_highest_attempt_the_agent_wrote_with_the_list(tmp_path: Path) -> None:
    """The sidecar sends the ``seen`` of the board it read the attempts from, so core
    judges only those the agent had been handed (``Heartbeat.seen``)."""
    beats: list[tuple[list[int], int | None]] = []

    class Core:
        async def heartbeat(self, worker_id: int, alive: list[int], **kw: object) -> object:
            beats.append((alive, kw.get("seen")))  # type: ignore[arg-type]
            return HeartbeatAnswer(state="live", stop=[])

    async def beat_once(board: Board) -> None:
        task = asyncio.create_task(
            beat_forever(tmp_path, board, 7, 0.05, 10.0, Core())  # type: ignore[arg-type]
        )
        while not beats:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    board = Board.create()
    try:
        # The agent is this process's parent as the sidecar sees it.
        board.write({"agent_pid": os.getppid(), "seen": 12, "attempts": {"9": 0, "12": -1}})
        asyncio.run(beat_once(board))
    finally:
        board.close()
    assert beats[0] == ([9, 12], 12)
