"""The benchmarks' shared start of a service (``bench/stack.py``, ``start_service``): a
benchmark stopped while a service it started is not ready yet (Ctrl-C, or SIGTERM made
to unwind like it: ``exit_on_sigterm``) leaves no process behind. The caller holds no
handle to it before it answers: ``bench/turn_ab.py`` stopped by SIGTERM left a core
running against its removed database, retrying forever."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from libs.common.embedded import EmbeddedPostgres
from tests.support.bench import load

# Never ready: it writes its pid and sleeps (nothing listens on the port asked).
_SLEEPER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"


def test_a_bench_stopped_while_its_service_starts_leaves_no_process(tmp_path: Path) -> None:
    stack = load("stack")
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


# A core that answers /readyz, writes its pid, and takes 2 s to stop on SIGTERM.
_SLOW_CORE = """
import http.server, os, signal, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), os._exit(0)))
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Ok).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone(pid: int) -> bool:
    """Whether the process is gone within 5 s (PostgreSQL's postmaster removes its pid
    file, which ``pg_ctl stop`` waits for, just before it exits)."""
    for _ in range(50):
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_second_signal_during_clean_up_does_not_cut_it_short(tmp_path: Path) -> None:
    """Ctrl-C stops a benchmark, and a second one comes while core takes its time to
    stop: ``core_stack`` still stops core and PostgreSQL and removes its folder (the
    second signal used to cut the clean-up short in ``proc.wait``, PostgreSQL left
    running), then the benchmark stops."""
    stack = load("stack")
    pidfile = tmp_path / "pid"
    port = stack.free_port()
    core = [sys.executable, "-c", _SLOW_CORE, str(pidfile), str(port)]
    second = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    found: list[Any] = []
    try:
        with (
            pytest.raises(KeyboardInterrupt),
            stack.core_stack("cairn-test-stack-", core, port=port) as started,
        ):
            found.append(started)
            second.start()
            raise KeyboardInterrupt  # the first
        second.join()
        [started] = found
        assert not _alive(int(pidfile.read_text())), "core still runs"
        assert _gone(started.postmaster_pid), "PostgreSQL still runs"
        assert not started.root.exists()
    finally:
        second.cancel()
        for started in found:  # what the old clean-up left running
            if started.root.exists():
                EmbeddedPostgres(started.root / "pg").stop()
                shutil.rmtree(started.root, ignore_errors=True)
        if pidfile.exists() and _alive(pid := int(pidfile.read_text())):
            os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str:
    fields = load("procstat").stat_fields(pid)
    assert fields is not None
    return str(fields[0])


def test_paused_stops_the_benchs_processes_and_lets_them_go_on_whatever_happens() -> None:
    """``paused``: a peer measured on the same server while core's loops would share it
    (``bench/dispatch.py``, ``bench/e2e.py``); core goes on after, also when the
    measurement fails."""
    stack = load("stack")
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with stack.paused(proc.pid):
            assert _state(proc.pid) == "T"
        assert _state(proc.pid) in ("S", "R")
        with pytest.raises(RuntimeError), stack.paused(proc.pid):
            assert _state(proc.pid) == "T"
            raise RuntimeError("the peer failed")
        assert _state(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()
