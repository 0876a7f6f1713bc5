"""A real service process logs JSON lines on a stderr that is not a terminal, uvicorn's
own lines included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, stop_process, wait_for

pytestmark = pytest.mark.slow


def test_core_writes_json_lines_to_a_pipe(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "CAIRN_DATABASE_URL": db_url,
        "CAIRN_HOME": str(tmp_path),
        "CAIRN_CORE_PORT": str(port),
        "CAIRN_LOG_LEVEL": "info",
    }
    env.pop("CAIRN_LOG_FORMAT", None)
    log = tmp_path / "core.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "services.core"], env=env, stderr=stderr)
        try:

            def ready() -> bool:
                assert proc.poll() is None, "core exited"
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).is_success
                except httpx.HTTPError:
                    return False

            wait_for(ready, timeout=60, interval=0.1)
        finally:
            stop_process(proc)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert lines, "core logged nothing at info"
    assert {line["service"] for line in lines} == {"core"}
    assert any(line["logger"].startswith("uvicorn") for line in lines)
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
