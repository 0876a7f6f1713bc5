"""Per-attempt step times, for benchmarks (``CAIRN_WORKER_TIMINGS_FILE``; off by default).

One JSON line per started attempt, wall-clock seconds (comparable with the database's
timestamps on the same host): ``sent`` (the turn that leased it left the agent),
``answered`` (its answer arrived), ``prepared`` (folders, executable and cgroup ready),
``spawned`` (the spawn returned a pid).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO


class Timings:
    """Collects the steps of each attempt and writes its line once it has spawned."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[str] | None = path.open("a", buffering=1) if path is not None else None
        self._steps: dict[int, dict[str, float]] = {}

    @property
    def on(self) -> bool:
        return self._file is not None

    def leased(self, attempt_ids: list[int], sent: float) -> None:
        if self._file is None:
            return
        now = time.time()
        for attempt_id in attempt_ids:
            self._steps[attempt_id] = {"sent": sent, "answered": now}

    def mark(self, attempt_id: int, step: str) -> None:
        if self._file is not None and attempt_id in self._steps:
            self._steps[attempt_id][step] = time.time()

    def done(self, attempt_id: int) -> None:
        steps = self._steps.pop(attempt_id, None)
        if self._file is not None and steps is not None:
            self._file.write(json.dumps({"attempt_id": attempt_id, **steps}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
