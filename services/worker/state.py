"""What the agent and its sidecar share on disk, in the worker's folder: the agent writes
``attempts.json`` (its pid, each attempt's process group); the sidecar writes
``answer.json`` (core's answer to its last heartbeat). Both are replaced atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ATTEMPTS = "attempts.json"
ANSWER = "answer.json"


def write(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any]:
    try:
        value: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return value


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
