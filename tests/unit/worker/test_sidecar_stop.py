"""SIGTERM, the agent stopping its sidecar, ends the sidecar at once, whatever it is
doing: here with a heartbeat in flight to a core that takes the request and never
answers. (Raised as SystemExit inside its loop, the loop's shutdown once waited for ever:
a sidecar was left sleeping after its agent and its test had gone.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.worker import state

ROOT = Path(__file__).resolve().parents[3]


def _silent_core() -> tuple[socket.socket, threading.Event]:
    """A listener that reads requests and answers none; the event is set at the first."""
    listener = socket.create_server(("127.0.0.1", 0))
    asked = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if conn.recv(65536):
                asked.set()

    threading.Thread(target=serve, daemon=True).start()
    return listener, asked


def test_sigterm_ends_the_sidecar_with_its_heartbeat_in_flight(tmp_path: Path) -> None:
    listener, asked = _silent_core()
    board = state.Board.create()
    try:
        # The agent is this process (the sidecar's parent), alive and turning.
        board.write({"agent_pid": os.getpid(), "attempts": {}})
        board.pulse(time.monotonic())
        port = listener.getsockname()[1]
        env = {**os.environ, "CAIRN_URL": f"http://127.0.0.1:{port}", "CAIRN_HOME": str(tmp_path)}
        folder = tmp_path / "worker"
        folder.mkdir()
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "services.worker.sidecar", str(folder), "1", "0.05", "180",
             str(board.fd), "--hang-s=300"],
            stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=(board.fd,), env=env,
            cwd=ROOT,
        )  # fmt: skip
        try:
            assert sidecar.stdin is not None
            sidecar.stdin.write(json.dumps({"token": "t", "lease": "l"}).encode())
            sidecar.stdin.close()
            assert asked.wait(30), "the sidecar sent no heartbeat"
            sidecar.terminate()
            began = time.monotonic()
            assert sidecar.wait(5) == 0
            assert time.monotonic() - began < 2
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
                sidecar.wait()
    finally:
        os.close(board.fd)
        listener.close()
