"""What the benchmarks share: a fresh embedded PostgreSQL (durable settings) in a temp
folder, every schema migrated, and core as its own process, stopped and removed after."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from procstat import stat_fields  # noqa: E402

from libs.common.embedded import EmbeddedPostgres  # noqa: E402
from services.core import migrate as core_migrate  # noqa: E402
from services.cron import migrate as cron_migrate  # noqa: E402
from services.dag import migrate as dag_migrate  # noqa: E402


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so a stopped benchmark still runs its ``finally``
    blocks and stops the servers and agents it started (by default Python just dies)."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held off while the block runs: a clean-up that a second Ctrl-C
    (or SIGTERM, ``exit_on_sigterm``) would cut short, leaving PostgreSQL or core
    running. One that came is delivered after a block that ended normally; if the block
    ends by an exception, the benchmark already stops. Python handles signals in the
    main thread only: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():  # None: not set from Python
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    for signum in dict.fromkeys(caught):
        signal.raise_signal(signum)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Stack:
    root: Path
    database_url: str
    core_url: str
    core_pid: int = 0
    postmaster_pid: int = 0


def start_service(
    module: str, env: dict[str, str], url: str, command: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """``python -m module`` (or ``command``) with ``env`` added, once ``url/readyz``
    answers 200."""
    argv = command or [sys.executable, "-m", module]
    proc = subprocess.Popen(argv, env={**os.environ, **env})
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{module} did not start")
            time.sleep(0.1)
    except BaseException:
        # Not started, or the benchmark stopped meanwhile (Ctrl-C, ``exit_on_sigterm``):
        # its caller has no handle to stop it by.
        with signals_held():
            proc.kill()
            proc.wait()
        raise


def start_core(
    database_url: str, home: Path, port: int, command: list[str] | None = None, **env: str
) -> subprocess.Popen[bytes]:
    """Core (``python -m services.core``, or ``command``: a benchmark's own app around
    core's) on ``port`` over a migrated database, once it answers ``/readyz``: one of a
    benchmark's core replicas."""
    return start_service(
        "services.core",
        {
            "CAIRN_DATABASE_URL": database_url,
            "CAIRN_HOME": str(home),
            "CAIRN_CORE_PORT": str(port),
            "CAIRN_LOG_LEVEL": "warning",
            "CAIRN_MIGRATE_ON_START": "false",
            **env,
        },
        f"http://127.0.0.1:{port}",
        command,
    )


def _running(pid: int) -> bool:
    """Whether the process is there and not stopped."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("T", "t")


@contextlib.contextmanager
def paused(*pids: int) -> Iterator[None]:
    """The benchmark's own processes ``pids`` stopped (``SIGSTOP``) meanwhile, then let
    go on: a peer measured on the same PostgreSQL then neither shares the machine with
    core's background loops nor has their statements counted in its server's CPU (idle,
    core spends about 20-25 ms a second and PostgreSQL 10-30 for it; 2026-12-07)."""
    stopped = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        for pid in stopped:  # the signal is taken asynchronously
            deadline = time.monotonic() + 5
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.001)
        yield
    finally:
        with signals_held():
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def core_database(prefix: str, fast: bool = True) -> Iterator[str]:
    """A fresh embedded PostgreSQL in a temp folder, with the tests' settings (``fast``:
    no fsync) unless ``fast`` is False, core's schema migrated: its URL (SQLAlchemy's
    form); stopped and removed after. For a benchmark of statements alone, with no core
    process."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    server = EmbeddedPostgres(root / "pg", fast=fast)
    url = server.start()
    try:
        core_migrate.upgrade(url)
        yield url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def core_stack(
    prefix: str, command: list[str] | None = None, port: int = 0, **core_env: str
) -> Iterator[Stack]:
    """The database and core (``python -m services.core``, or ``command``; on ``port``,
    else a free one) for one benchmark run."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    server = EmbeddedPostgres(root / "pg")
    proc: subprocess.Popen[bytes] | None = None
    try:
        url = server.start()
        for upgrade in (core_migrate.upgrade, cron_migrate.upgrade, dag_migrate.upgrade):
            upgrade(url)
        port = port or free_port()
        core_url = f"http://127.0.0.1:{port}"
        proc = start_core(url, root / "home", port, command, **core_env)
        postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
        yield Stack(root, url, core_url, proc.pid, postmaster)
    finally:
        # To its end, whatever comes meanwhile: a second Ctrl-C, a core slow to stop.
        with signals_held():
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            server.stop()
            shutil.rmtree(root, ignore_errors=True)
