"""Helpers the tests share: a real core server on loopback, tokens, task specs."""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import gc
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
import pytest
import uvicorn
from click.testing import Result
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from typer.testing import CliRunner

from libs.common import waits
from libs.common.settings import libpq_url
from services.core import admin
from services.core import migrate as core_migrate
from services.core.app import create_app
from services.core.settings import CoreSettings
from services.cron import migrate as cron_migrate
from services.dag import migrate as dag_migrate

T = TypeVar("T")

# Every service's schema, migrated into the template database each test clones.
MIGRATIONS = [core_migrate.upgrade, cron_migrate.upgrade, dag_migrate.upgrade]

TRUE_SHA = hashlib.sha256(Path("/bin/true").read_bytes()).hexdigest()
SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()


# Where tests' servers listen: below the kernel's ephemeral range, from which every
# outgoing connection takes its own port. A port picked there (bound to 0, closed) could
# be taken by some client's connect before the test's server bound it: CI once met
# "address already in use" starting a core.
_LISTEN_PORTS = range(20000, 32768)
_handed_out: collections.deque[int] = collections.deque(maxlen=512)
# Its own source: a test that seeds the module's (hypothesis does) would give every test
# process the same ports in the same order.
_pick = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range where it can be
    (random, checked by a bind; not one this process handed out lately)."""
    top = min(_LISTEN_PORTS.stop, _ephemeral_low())
    for _ in range(1000 if top > _LISTEN_PORTS.start else 0):
        port = _pick.randrange(_LISTEN_PORTS.start, top)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.append(port)
        return port
    with socket.socket() as sock:  # no room below the ephemeral range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_token(db_url: str, name: str, role: str) -> str:
    return admin.create_token(db_url, name, role)


def spec(**overrides: Any) -> dict[str, Any]:
    """A valid submission body, with ``overrides`` applied."""
    body: dict[str, Any] = {
        "name": "test-task",
        "artifact": {"uri": "file:///bin/true", "sha256": TRUE_SHA},
        "args": [],
    }
    body.update(overrides)
    return body


def shell_spec(script: str, **overrides: Any) -> dict[str, Any]:
    """A submission that runs ``sh -c script``, with ``overrides`` applied."""
    artifact = {"uri": f"file://{SH}", "sha256": SH_SHA}
    return spec(**{"name": "sh", "artifact": artifact, "args": ["-c", script], **overrides})


class Served:
    """A service the tests serve from a thread (:func:`serve_in_thread`): clients of it as
    a principal, and its stop."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def token(self, name: str, role: str) -> str:
        """The principal's token (made with ``role`` if new)."""
        raise NotImplementedError

    def client(self, name: str = "alice", role: str = "user") -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.token(name, role)}"},
            timeout=httpx.Timeout(30.0, connect=5.0),
        )

    def stop(self) -> None:
        """Stop serving and wait for the thread; one that outlives ``STOP_JOIN_S`` fails the
        test with where its thread and its loop's tasks wait (a hang was a silent 15 s
        pause of a teardown, the service left running)."""
        if isinstance(self.server, ThreadServer):
            self.server.exit()
        else:
            self.server.should_exit = True
        self.thread.join(timeout=STOP_JOIN_S)
        # A database connection the service's loops were opening when it stopped is left
        # half open until the cycle holding it is collected: its backend waits in
        # authentication, and the drop of the test's database with it, for PostgreSQL's
        # 60 s authentication_timeout. The young generations hold it: collect them now.
        gc.collect(1)
        if self.thread.is_alive():
            where = _waits_in(self.thread, getattr(self.server, "_loop", None))
            raise AssertionError(f"{self.thread.name} did not stop in {STOP_JOIN_S} s:\n{where}")


#: how long ``Served.stop`` waits for a service's thread
STOP_JOIN_S = 15.0


def _waits_in(thread: threading.Thread, loop: asyncio.AbstractEventLoop | None) -> str:
    """Where ``thread`` is, and where each task of its event loop waits."""
    lines = [f"thread {thread.name}:\n"]
    frame = sys._current_frames().get(thread.ident or 0)
    lines += traceback.format_stack(frame) if frame is not None else ["  (no frame)\n"]
    tasks: list[asyncio.Task[Any]] = []
    for _ in range(10):  # the set changes as the loop runs in its thread
        with contextlib.suppress(RuntimeError):
            tasks = list(asyncio.all_tasks(loop)) if loop is not None else []
            break
    return "".join(lines + [waits.awaiting(task) for task in tasks])


@dataclass
class Core(Served):
    """A core server running in a thread, serving real HTTP on 127.0.0.1; it keeps the
    tokens of the test's principals (the other services' clients use them too)."""

    url: str
    db_url: str
    server: uvicorn.Server
    thread: threading.Thread
    tokens: dict[str, str] = field(default_factory=dict)

    def token(self, name: str, role: str) -> str:
        if name not in self.tokens:
            self.tokens[name] = make_token(self.db_url, name, role)
        return self.tokens[name]


class ThreadServer(uvicorn.Server):
    """uvicorn's server, whose main loop also wakes when :meth:`exit` tells it to stop:
    uvicorn's own looks at ``should_exit`` every 0.1 s, and the tests stop one or more
    servers a test. The loop is uvicorn's otherwise (a tick every 0.1 s), and so is the
    shutdown (:meth:`shutdown`), but for its fixed pauses."""

    _loop: asyncio.AbstractEventLoop | None = None
    _woken: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._woken = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown, without its fixed 0.1 s pause after asking the open
        connections to close and its 0.1 s steps while waiting on them: the same waits
        (each open connection and request ends, up to the graceful bound), looked at every
        5 ms, so a stop with nothing open costs no 0.1 s (a test stops one or more servers).
        Then the application's shutdown, as uvicorn's."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while (state.connections or state.tasks) and not self.force_exit:
                    await asyncio.sleep(0.005)
        except TimeoutError:
            for task in state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()

    def exit(self) -> None:
        """Stop serving (uvicorn's graceful shutdown), from any thread; first the app's
        ``state.on_exit`` hooks, as ``libs.common.serve`` runs them on SIGTERM (core's
        closes its line of waiting claims: a worker's long poll would hold the shutdown
        for its whole wait)."""
        self.should_exit = True
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None:
            state = getattr(self.config.app, "state", None)
            with contextlib.suppress(RuntimeError):  # the loop has closed: it has exited
                for hook in getattr(state, "on_exit", ()):
                    loop.call_soon_threadsafe(hook)
                loop.call_soon_threadsafe(woken.set)


def stop_as_woken(served: Served, task: str, wake: Callable[[], object], within_s: float) -> bool:
    """Cancel ``served``'s task named ``task``, as its lifespan's stop does, in the same pass
    of its event loop as ``wake`` wakes that task's loop from its sleep, as a change heard
    does; whether the task ended within ``within_s``. ``asyncio.wait_for`` on Python 3.11
    lost such a cancel (``libs.common.waits``) and the task never ended."""

    async def stop() -> bool:
        stopped = next(t for t in asyncio.all_tasks() if t.get_name() == task)
        wake()
        stopped.cancel()
        done, _ = await asyncio.wait({stopped}, timeout=within_s)
        return bool(done)

    assert isinstance(served.server, ThreadServer) and served.server._loop is not None
    return asyncio.run_coroutine_threadsafe(stop(), served.server._loop).result(within_s + 10)


def serve_in_thread(app: Any, port: int, name: str) -> tuple[uvicorn.Server, threading.Thread]:
    """Serve ``app`` on 127.0.0.1:``port`` from a thread; return once it accepts requests."""
    server = ThreadServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True, name=f"{name}-{port}")
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.01)
    return server, thread


#: the tests' webhook receivers listen on loopback, which core refuses unless an
#: administrator opens it (CAIRN_NOTIFY_ALLOW_CIDRS); the database's port stays refused
LOOPBACK_WEBHOOKS = "127.0.0.0/8"


#: Core's reaper out of the way (no heartbeat bound passes during a test): for the tests
#: that drive workers' turns by hand and reap by hand
REAPER_AWAY = pytest.mark.core(heartbeat_timeout_s=3600.0)


def start_core(db_url: str, home: Path, port: int | None = None, **settings: Any) -> Core:
    port = port or free_port()
    defaults = {
        "promote_interval_s": 0.2,
        "token_cache_s": 0,
        "notify_allow_cidrs": LOOPBACK_WEBHOOKS,
    }
    config = CoreSettings(
        home=home, database_url=db_url, core_port=port, **{**defaults, **settings}
    )
    app = create_app(config, config.database_url or db_url)
    server, thread = serve_in_thread(app, port, "core")
    return Core(url=f"http://127.0.0.1:{port}", db_url=db_url, server=server, thread=thread)


@contextmanager
def fresh_database(server_url: str, template_db: str, prefix: str) -> Iterator[str]:
    """A new clone of the migrated template database on the server at ``server_url``
    (dropped afterwards): its URL."""
    name = prefix + uuid.uuid4().hex[:16]
    admin = libpq_url(server_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield server_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def wait_for(
    predicate: Any,
    timeout: float = 10.0,
    interval: float = 0.02,
    seen: Callable[[], object] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``,
    saying what ``seen()`` returns then (what the test waited on, as it stands)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            found = f": {seen()}" if seen is not None else ""
            raise AssertionError(f"condition not met within {timeout} s{found}")
        time.sleep(interval)


def with_engine(db_url: str, work: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """``work`` over an engine of its own on ``db_url`` (disposed after), in a new event
    loop: its result."""

    async def run() -> T:
        engine = create_async_engine(db_url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _popen(command: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen[bytes]:
    """``command`` as a child, its output to ``log`` when given (else the test's own)."""
    if log is None:
        return subprocess.Popen(command, env=env)
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _started(
    module: str,
    port_variable: str,
    db_url: str,
    home: Path,
    port: int,
    log: Path | None,
    env: dict[str, str],
) -> tuple[subprocess.Popen[bytes], Callable[[], None]]:
    """A service started as its own process, and what waits until it serves."""
    environment = {
        **os.environ,
        "CAIRN_DATABASE_URL": db_url,
        "CAIRN_HOME": str(home),
        port_variable: str(port),
        "CAIRN_LOG_LEVEL": "warning",
        **env,
    }
    proc = _popen([sys.executable, "-m", module], environment, log)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{module} exited with {proc.returncode}")
        try:
            return httpx.get(url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return proc, lambda: wait_for(ready, timeout=60, interval=0.1)


def spawn_service(
    module: str,
    port_variable: str,
    db_url: str,
    home: Path,
    port: int,
    *,
    log: Path | None = None,
    **env: str,
) -> subprocess.Popen[bytes]:
    """A service as its own process (``python -m <module>``), ready to serve; with
    ``log``, its output goes to that file."""
    proc, serving = _started(module, port_variable, db_url, home, port, log, env)
    serving()
    return proc


def spawn_core(
    db_url: str, home: Path, port: int, *, log: Path | None = None, **env: str
) -> subprocess.Popen[bytes]:
    """Core as its own process (``python -m services.core``), ready to serve."""
    return spawn_service("services.core", "CAIRN_CORE_PORT", db_url, home, port, log=log, **env)


def spawn_cores(
    db_url: str, places: Sequence[tuple[Path, int]], **env: str
) -> list[subprocess.Popen[bytes]]:
    """Cores as processes of their own (a home and a port each), started together so that
    their starts (a second or two of imports each) overlap, then each waited for until it
    serves; if one never does, all are killed."""
    started = [
        _started("services.core", "CAIRN_CORE_PORT", db_url, home, port, None, env)
        for home, port in places
    ]
    try:
        for _, serving in started:
            serving()
    except BaseException:
        for proc, _ in started:
            stop_process(proc, signal.SIGKILL)
        raise
    return [proc for proc, _ in started]


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` to the process (by its pid) and reap it."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


_RUN_ROOT: list[Path] = []


def _run_root() -> Path:
    if not _RUN_ROOT:
        root = Path(tempfile.mkdtemp(prefix="cairn-tests-", dir="/var/tmp"))
        root.chmod(0o711)
        atexit.register(shutil.rmtree, root, True)
        _RUN_ROOT.append(root)
    return _RUN_ROOT[0]


def isolation_env() -> dict[str, str]:
    """What a worker agent in a test needs to run attempts as uids of their own: a run
    folder every parent of which others may search (the tests' tmp folders are 0700),
    removed when the test process ends, and a uid range per xdist worker (agents of one
    test process share one lock folder, so they never share a uid)."""
    root = _run_root()
    run = Path(tempfile.mkdtemp(dir=root))
    run.chmod(0o711)
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = 20000 + 1000 * (index % 9)
    return {
        "CAIRN_WORKER_RUN_DIR": str(run),
        "CAIRN_WORKER_UID_LOCKS": str(root / "uids"),
        "CAIRN_WORKER_UIDS": f"{first}-{first + 999}",
    }


def shared_dir() -> Path:
    """A folder that tests and the attempts' uids can both write (markers, pid files)."""
    folder = Path(tempfile.mkdtemp(dir=_run_root(), prefix="shared-"))
    folder.chmod(0o1777)
    return folder


def spawn_worker(
    core: Core,
    home: Path,
    name: str,
    cpu: float = 4,
    memory_mb: int = 8192,
    *,
    log: Path | None = None,
    **env: str,
) -> subprocess.Popen[bytes]:
    """A real worker agent (``python -m services.worker``) with its sidecar; with ``log``,
    its output goes to that file."""
    environment = {
        **os.environ,
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": make_token(core.db_url, name, "worker"),
        "CAIRN_HOME": str(home),
        "CAIRN_WORKER_CPU": str(cpu),
        "CAIRN_WORKER_MEMORY_MB": str(memory_mb),
        "CAIRN_WORKER_DRAIN_GRACE_S": "5",
        "CAIRN_LOG_LEVEL": "warning",
        **isolation_env(),
        **env,
    }
    return _popen([sys.executable, "-m", "services.worker"], environment, log)


class Workers:
    """The worker agents one test starts (:func:`spawn_worker`), SIGKILLed and reaped by
    :meth:`stop_all` (the ``workers`` fixture calls it when the test ends)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self, core: Core, home: Path, name: str, cpu: float = 4, memory_mb: int = 8192, **env: str
    ) -> subprocess.Popen[bytes]:
        proc = spawn_worker(core, home, name, cpu=cpu, memory_mb=memory_mb, **env)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            stop_process(proc, signal.SIGKILL)


class TurnWorker:
    """A worker the test drives turn by turn over core's HTTP API (no agent)."""

    def __init__(self, core: Core, name: str) -> None:
        self.http = core.client(name, "worker")
        offer = {"hostname": name, "queues": ["default"], "cpu": 8, "memory_mb": 16384}
        answer = self.http.post("/v1/workers", json=offer)
        assert answer.status_code == 201, answer.text
        self.id = answer.json()["worker"]["id"]
        self.http.headers["X-Cairn-Worker-Lease"] = answer.json()["lease"]

    def post_turn(self, **body: Any) -> httpx.Response:
        return self.http.post(f"/v1/workers/{self.id}/turn", json=body, timeout=30)

    def turn(self, **body: Any) -> dict[str, Any]:
        answer = self.post_turn(**body)
        assert answer.status_code == 200, answer.text
        return answer.json()


def register_worker(http: httpx.Client, offer: dict[str, Any]) -> int:
    """Register a worker through ``http``, which then carries its lease secret; its id."""
    answer = http.post("/v1/workers", json=offer)
    answer.raise_for_status()
    http.headers["X-Cairn-Worker-Lease"] = answer.json()["lease"]
    return int(answer.json()["worker"]["id"])


def cli_as(
    core: Core,
    monkeypatch: pytest.MonkeyPatch,
    home: Path,
    name: str = "alice",
    role: str = "user",
    columns: int = 200,
) -> CliRunner:
    """The real CLI, run in this process against ``core`` as ``name`` (made with ``role``
    if new), with a home and config of the test's own."""
    with core.client(name, role):
        pass  # the principal's token
    monkeypatch.setenv("CAIRN_HOME", str(home / "home"))
    monkeypatch.setenv("CAIRN_CONFIG", str(home / "none.toml"))
    monkeypatch.setenv("CAIRN_URL", core.url)
    monkeypatch.setenv("CAIRN_TOKEN", core.tokens[name])
    monkeypatch.setenv("COLUMNS", str(columns))
    return CliRunner()


def cairn_cli(
    *args: str, env: Mapping[str, str | None] | None = None, input: str | None = None
) -> Result:
    """``cairn ARGS``, the real CLI run in this process with ``env`` over the test's own
    environment: a subprocess paid Python's start and the CLI's imports (1-2.5 s of wall
    under the suite's load) for each command; the tests that are about the process itself
    (a terminal, a login's prompts, `cairn up`) still start one."""
    from cairn.cli import app

    return CliRunner().invoke(app, list(args), env=env, input=input)
