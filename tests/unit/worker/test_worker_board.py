"""The board the agent shares with its sidecar (``services.worker.state.Board``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
