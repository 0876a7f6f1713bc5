"""An agent told to stop (SIGTERM, as a node's shutdown or a rollout sends) before core
registered it stops: it holds nothing yet. It waited on for a core that was down, retrying
its registration, until SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import Core, free_port

ROOT = Path(__file__).resolve().parents[3]


def test_sigterm_while_core_cannot_be_reached_stops_the_agent(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "CAIRN_TOKEN": "a-worker-token",
        "CAIRN_WORKER_ISOLATION": "none",
    }
    with log.open("w") as stderr:
        agent = subprocess.Popen(
            [sys.executable, "-m", "services.worker"], env=env, cwd=tmp_path, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 60
        while "core not reachable yet" not in log.read_text():
            assert agent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        agent.send_signal(signal.SIGTERM)
        try:
            code = agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        agent.kill()
        agent.wait()
    assert code == 0, log.read_text()
    assert "stopped before core registered this worker" in log.read_text()


def test_a_token_core_refuses_stops_the_agent_in_one_line(core: Core, tmp_path: Path) -> None:
    # a traceback ending in libs.common.errors.Unauthorized
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": "cairn_revoked-or-never-made",
        "CAIRN_WORKER_ISOLATION": "none",
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.worker"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cairn worker: core refused to register this worker (401 ")
    assert "--role worker" in last
