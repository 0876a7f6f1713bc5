"""Running Cairn itself: the embedded database, migrations, tokens, and `cairn up`, which
starts every service and a worker on loopback and stops them all on Ctrl-C."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import httpx

from cairn.output import visible
from libs.common import procs
from libs.common.settings import CairnSettings

if TYPE_CHECKING:  # loaded where a command starts a database: psycopg is not light
    from libs.common.embedded import EmbeddedPostgres

ROLES = ("admin", "service", "user", "worker")


def database(
    settings: CairnSettings, *, adopt: bool = False
) -> tuple[str, EmbeddedPostgres | None]:
    """The database URL, and the embedded server if this call started it (or, with
    ``adopt``, found it running: left by a `cairn up` that was killed)."""
    if settings.database_url:
        return settings.database_url, None
    from libs.common.embedded import EmbeddedPostgres

    server = EmbeddedPostgres(settings.home / "pg")
    was_running = server.running() if (server.data / "PG_VERSION").exists() else False
    if was_running and adopt:
        print(
            f"cairn: the database server of {settings.home} was still running (pid "
            f"{server.pid()}), left by an earlier `cairn up`; using it",
            file=sys.stderr,
        )
    url = server.start()
    return url, (None if was_running and not adopt else server)


class AlreadyUp(RuntimeError):
    """Another `cairn up` runs with this home."""


@contextlib.contextmanager
def home_lock(settings: CairnSettings) -> Iterator[None]:
    """Hold ``$CAIRN_HOME/up.lock`` while `cairn up` runs: one `cairn up` per home."""
    with open(settings.home / "up.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AlreadyUp(
                f"another `cairn up` is running with CAIRN_HOME={settings.home}; "
                "stop it first, or give this one a home of its own"
            ) from None
        yield


def _services_file(settings: CairnSettings) -> Path:
    return settings.home / "up.json"


def stop_leftovers(settings: CairnSettings) -> None:
    """Stop the services an earlier `cairn up` of this home left running (it was killed
    before it could): found by the pids and start times it recorded."""
    path = _services_file(settings)
    try:
        recorded = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return
    for name, pid, started in recorded.get("services", []):
        if procs.start_time(int(pid)) == int(started):
            print(
                f"cairn: stopping {name} (pid {pid}), left by an earlier `cairn up`",
                file=sys.stderr,
            )
            procs.stop_pid(int(pid), int(started))
    path.unlink(missing_ok=True)


def check_ports(urls: dict[str, str], settings: CairnSettings) -> None:
    ports = {
        "core": ("CAIRN_CORE_PORT", settings.core_port),
        "cron": ("CAIRN_CRON_PORT", settings.cron_port),
        "dag": ("CAIRN_DAG_PORT", settings.dag_port),
    }
    for name, (variable, port) in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((settings.bind_host, port))
            except OSError:
                raise RuntimeError(
                    f"{name}'s port {port} ({urls[name]}) is in use by another program: "
                    f"stop it, or choose another port with {variable}"
                ) from None


def prepare_home(settings: CairnSettings) -> None:
    settings.home.mkdir(parents=True, exist_ok=True, mode=0o700)


def migrate_all(url: str) -> None:
    """Every service's schema, to its newest migration."""
    from services.core import migrate as core_migrate
    from services.cron import migrate as cron_migrate
    from services.dag import migrate as dag_migrate

    core_migrate.upgrade(url)
    cron_migrate.upgrade(url)
    dag_migrate.upgrade(url)


def migrate_or_exit(url: str) -> None:
    """``migrate_all`` for a command: when a migration gives up behind a blocker, or its
    server is lost or unreachable, its message (whom it waited for, what to do; which
    server and what error) on stderr and exit status 1, not a traceback."""
    from libs.common.migrations import MigrationFailed  # alembic: only when migrating

    try:
        migrate_all(url)
    except MigrationFailed as blocked:
        print(f"cairn: {visible(str(blocked))}", file=sys.stderr)
        raise SystemExit(1) from None


def local_token(settings: CairnSettings, url: str, name: str, role: str) -> str:
    """A token for local use, kept in ``$CAIRN_HOME/NAME-token`` (mode 0600) and reused."""
    from services.core import admin

    path = settings.home / f"{name}-token"
    if path.exists():
        token = path.read_text().strip()
        principal = admin.principal_for(url, token)
        if principal is not None and principal.role == role:
            return token
    token = admin.create_token(url, name, role)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def worker_run_dir(settings: CairnSettings) -> dict[str, str]:
    """Where the local worker makes attempts' folders, when root runs it and the home is
    out of other users' reach (as ``~/.cairn`` under ``/root`` is): a folder per home
    under ``/var/lib/cairn``, which the attempts' uids can pass through."""
    from services.worker.isolation import searchable_by_others

    if "CAIRN_WORKER_RUN_DIR" in os.environ or os.geteuid() != 0:
        return {}
    if searchable_by_others(settings.home / "attempts") is None:
        return {}
    tag = hashlib.sha256(str(settings.home).encode()).hexdigest()[:12]
    return {"CAIRN_WORKER_RUN_DIR": f"/var/lib/cairn/attempts-{tag}"}


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f} s")


def stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """Stop the processes by pid, the last started first (workers hand back through core)."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _relay(name: str, stream: IO[bytes], lock: threading.Lock) -> None:
    """Copy a child's output to ours, each line led by the child's name."""
    width = 6
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        with lock:
            sys.stderr.write(f"{name:<{width}}| {visible(line)}\n")
            sys.stderr.flush()
    stream.close()


@dataclass
class Stack:
    """The processes `cairn up` started, each relaying its log."""

    env: dict[str, str]
    record: Path | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, name: str, module: str, **extra: str | None) -> subprocess.Popen[bytes]:
        """Start ``python -m module`` with the stack's environment and ``extra`` (a value
        of None removes that variable). Each service dies with `cairn up`, even when it is
        killed outright."""
        env = {k: v for k, v in {**self.env, **extra}.items() if v is not None}
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=procs.die_with_parent(),
        )
        assert proc.stdout is not None
        threading.Thread(target=_relay, args=(name, proc.stdout, self._lock), daemon=True).start()
        self.procs.append(proc)
        self.names.append(name)
        self._write_record()
        return proc

    def _write_record(self) -> None:
        if self.record is None:
            return
        services = [
            (name, proc.pid, procs.start_time(proc.pid) or 0)
            for name, proc in zip(self.names, self.procs, strict=True)
        ]
        self.record.write_text(json.dumps({"services": services}))

    def dead(self) -> tuple[str, int] | None:
        for name, proc in zip(self.names, self.procs, strict=True):
            if proc.poll() is not None:
                return name, proc.returncode
        return None


def up(settings: CairnSettings, on_ready: Callable[[dict[str, str], str], None] | None) -> int:
    """Start the database (embedded unless a URL is set), core, cron, dag and a worker on
    loopback; call ``on_ready(urls, admin_token)``; wait for Ctrl-C; stop everything."""
    prepare_home(settings)
    try:
        with home_lock(settings):
            return _up_locked(settings, on_ready)
    except AlreadyUp as exc:
        print(f"cairn: {exc}", file=sys.stderr)
        return 1


def _up_locked(
    settings: CairnSettings, on_ready: Callable[[dict[str, str], str], None] | None
) -> int:
    stop_leftovers(settings)
    url, started = database(settings, adopt=True)
    direct = settings.direct_url(url)  # migrations and tokens: not through a pooler
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host = settings.bind_host
    urls = {
        "core": f"http://{host}:{settings.core_port}",
        "cron": f"http://{host}:{settings.cron_port}",
        "dag": f"http://{host}:{settings.dag_port}",
    }
    stack = Stack(
        record=_services_file(settings),
        env={
            **os.environ,
            "CAIRN_DATABASE_URL": url,
            "CAIRN_MIGRATE_ON_START": "false",
            # Core's dashboard links into cron and dag; they let its pages call them.
            "CAIRN_CRON_URL": urls["cron"],
            "CAIRN_DAG_URL": urls["dag"],
            # The relayed log is for a person at a terminal: one short text line each.
            "CAIRN_LOG_FORMAT": os.environ.get(
                "CAIRN_LOG_FORMAT", "text" if sys.stderr.isatty() else "json"
            ),
        },
    )
    try:
        check_ports(urls, settings)
        migrate_all(direct)
        token = local_token(settings, direct, "admin", "admin")
        wait_ready(urls["core"], stack.start("core", "services.core"))
        services = {"CAIRN_URL": urls["core"], "CAIRN_DAG_URL": urls["dag"]}
        dag_token = local_token(settings, direct, "dag", "service")
        wait_ready(
            urls["dag"], stack.start("dag", "services.dag", **services, CAIRN_TOKEN=dag_token)
        )
        cron_token = local_token(settings, direct, "cron", "service")
        wait_ready(
            urls["cron"], stack.start("cron", "services.cron", **services, CAIRN_TOKEN=cron_token)
        )
        local_token(settings, direct, "local-worker", "worker")
        stack.start(
            "worker",
            "services.worker",
            # A worker holds neither the database URL nor a token in its environment.
            CAIRN_DATABASE_URL=None,
            CAIRN_DATABASE_DIRECT_URL=None,
            CAIRN_TOKEN=None,
            CAIRN_URL=urls["core"],
            CAIRN_TOKEN_FILE=str(settings.home / "local-worker-token"),
            CAIRN_WORKER_DRAIN_GRACE_S=os.environ.get("CAIRN_WORKER_DRAIN_GRACE_S", "5"),
            # One person's machine: the worker's own credentials may fetch from any bucket
            # (docs/security.md, "Artifact credentials"), unless the environment says less.
            CAIRN_WORKER_S3_OWN_BUCKETS=os.environ.get("CAIRN_WORKER_S3_OWN_BUCKETS", "*"),
            **worker_run_dir(settings),
        )
        where = f"embedded, {settings.home / 'pg'}" if started else "as configured"
        print(
            "\ncairn is up\n"
            + f"  dashboard {urls['core']}/ui  (log in with the token below)\n"
            + "".join(f"  {name:<9} {u}  (OpenAPI at {u}/docs)\n" for name, u in urls.items())
            + f"  worker    queues {settings.worker_queues}, {settings.worker_cpu:g} CPU, "
            f"{settings.worker_memory_mb} MB\n"
            f"  database  {where}\n"
            f"  token     {token}  (admin; also in {settings.home / 'admin-token'})\n"
            "The cairn command uses that token by default: try `cairn ls`, `cairn workers`.",
            flush=True,
        )
        if on_ready is not None:
            on_ready(urls, token)
        print("Ctrl-C stops everything.\n", flush=True)
        while not stopping:
            dead = stack.dead()
            if dead:
                print(f"cairn: {dead[0]} exited with status {dead[1]}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    except RuntimeError as exc:  # a port taken, a migration given up on, a start failed
        print(f"cairn: {visible(str(exc))}", file=sys.stderr)
        return 1
    finally:
        stop(stack.procs)
        _services_file(settings).unlink(missing_ok=True)
        if started is not None:
            started.stop()
        print("cairn stopped", flush=True)
