"""`cairn up` on a fresh home: the embedded database, core, a token; Ctrl-C stops it all,
and the next start finds the data again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libs.common.embedded import EmbeddedPostgres
from tests.support import free_port, isolation_env, spec, wait_for
from tests.support.procs import children

pytestmark = pytest.mark.slow


@pytest.fixture
def own_tmp() -> Iterator[Path]:
    """A folder outside pytest's own: pytest makes its temp root 0700 again whenever
    another test process starts using it, which would lock the embedded server's user out
    of a data directory below it."""
    root = Path(tempfile.mkdtemp(prefix="cairn-up-test-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


_CRON_PORTS: dict[int, int] = {}


def cron_port(core_port: int) -> int:
    return _CRON_PORTS.setdefault(core_port, free_port())


_DAG_PORTS: dict[int, int] = {}


def dag_port(core_port: int) -> int:
    return _DAG_PORTS.setdefault(core_port, free_port())


def _up(home: Path, port: int, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "CAIRN_HOME": str(home),
        "CAIRN_CORE_PORT": str(port),
        "CAIRN_CRON_PORT": str(cron_port(port)),
        "CAIRN_DAG_PORT": str(dag_port(port)),
        "CAIRN_DAG_URL": f"http://127.0.0.1:{dag_port(port)}",
        "CAIRN_URL": f"http://127.0.0.1:{port}",
        **isolation_env(),
    }
    env.pop("CAIRN_DATABASE_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "cairn", "up", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_up(proc: subprocess.Popen[str]) -> str:
    """The output up to the "Ctrl-C" line; the rest is drained in the background (kept on
    ``proc.log``) so that the services' log never fills the pipe."""
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            banner = "".join(lines)
            threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
            proc.log = lines  # type: ignore[attr-defined]
            return banner
    raise AssertionError("cairn up ended early:\n" + "".join(lines))


def _reap(proc: subprocess.Popen[str]) -> None:
    """After a failed test: stop `cairn up` the way a person would (its services run in
    sessions of their own, so killing it outright would orphan them)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def test_up_serves_then_stops_everything_on_ctrl_c(own_tmp: Path) -> None:
    tmp_path = own_tmp
    home, port = tmp_path / "home", free_port()
    proc = _up(home, port)
    try:
        banner = _wait_up(proc)
        token = (home / "admin-token").read_text().strip()
        assert token in banner
        assert (home / "admin-token").stat().st_mode & 0o777 == 0o600
        assert home.stat().st_mode & 0o077 in (0, 0o001)
        headers = {"Authorization": f"Bearer {token}"}
        task = httpx.post(f"http://127.0.0.1:{port}/v1/tasks", json=spec(), headers=headers)
        assert task.status_code == 201
        cron = f"http://127.0.0.1:{cron_port(port)}"
        assert httpx.get(cron + "/readyz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{dag_port(port)}/readyz").status_code == 200
        # The only cron replica takes the lead.
        wait_for(lambda: httpx.get(cron + "/v1/cron/status", headers=headers).json()["leader"], 10)
        # The local worker runs it (/bin/true).
        url = f"http://127.0.0.1:{port}/v1/tasks/{task.json()['id']}"
        wait_for(lambda: httpx.get(url, headers=headers).json()["state"] == "succeeded", 30)
        # The worker was given neither the database URL nor a token in its environment.
        [worker] = [
            child.pid for child in children(proc.pid) if b"services.worker\x00" in child.cmdline
        ]
        environ = Path(f"/proc/{worker}/environ").read_bytes()
        assert b"CAIRN_DATABASE_URL" not in environ and b"CAIRN_TOKEN=" not in environ
        assert b"CAIRN_TOKEN_FILE=" in environ
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        _reap(proc)
    server = EmbeddedPostgres(home / "pg")
    assert not server.running()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz")

    again = _up(home, port)
    try:
        _wait_up(again)
        found = httpx.get(f"http://127.0.0.1:{port}/v1/tasks/{task.json()['id']}", headers=headers)
        assert found.status_code == 200 and found.json()["name"] == "test-task"
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=60) == 0
    finally:
        _reap(again)
    wait_for(lambda: not server.running(), timeout=10)


def _serving(url: str) -> bool:
    try:
        httpx.get(url + "/healthz", timeout=1.0)
    except httpx.HTTPError:
        return False
    return True


def test_after_cairn_up_is_killed_its_services_die_and_the_next_start_works(
    own_tmp: Path,
) -> None:
    home, port = own_tmp / "home", free_port()
    core = f"http://127.0.0.1:{port}"
    proc = _up(home, port)
    try:
        _wait_up(proc)
        token = (home / "admin-token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        task = httpx.post(core + "/v1/tasks", json=spec(), headers=headers).json()
        proc.kill()
        proc.wait(timeout=10)
        # Every service got the parent-death signal: the ports are free again.
        for url in (
            core,
            f"http://127.0.0.1:{cron_port(port)}",
            f"http://127.0.0.1:{dag_port(port)}",
        ):
            wait_for(lambda url=url: not _serving(url), timeout=30)
    finally:
        _reap(proc)
    server = EmbeddedPostgres(home / "pg")
    assert server.running()  # the database outlives its starter: the next start adopts it

    again = _up(home, port)
    try:
        banner = _wait_up(again)
        assert "left by an earlier `cairn up`" in banner
        found = httpx.get(f"{core}/v1/tasks/{task['id']}", headers=headers)
        assert found.status_code == 200
        second = _up(home, free_port())
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 1 and "another `cairn up` is running" in out
        again.send_signal(signal.SIGINT)
        assert again.wait(timeout=60) == 0
    finally:
        _reap(again)
    wait_for(lambda: not server.running(), timeout=10)
