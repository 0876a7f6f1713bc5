"""The benchmarks' shared start of a service (``bench/stack.py``, ``start_service``): a
benchmark stopped while a service it started is not ready yet (Ctrl-C, or SIGTERM made
to unwind like it: ``exit_on_sigterm``) leaves no process behind. The caller holds no
handle to it before it answers: ``bench/turn_ab.py`` stopped by SIGTERM left a core
running against its removed database, retrying forever."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"

# Never ready: it writes its pid and sleeps (nothing listens on the port asked).
_SLEEPER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"


def test_a_bench_stopped_while_its_service_starts_leaves_no_process(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_stack", BENCH / "stack.py")
    assert spec is not None and spec.loader is not None
    stack = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stack  # dataclasses look their module up
    spec.loader.exec_module(stack)
    pidfile = tmp_path / "pid"

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            stack.start_service(
                "sleeper",
                {},
                "http://127.0.0.1:27917",
                [sys.executable, "-c", _SLEEPER, str(pidfile)],
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pid = int(pidfile.read_text())
    try:
        gone = False
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                gone = True
                break
            time.sleep(0.1)
        assert gone, "the service the benchmark was starting still runs"
    finally:
        if not gone:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
