"""Cairn behind PgBouncer in transaction mode, for real: Debian's ``/usr/sbin/pgbouncer``
in front of the embedded PostgreSQL, core, cron, dag and a worker agent as processes with
``CAIRN_DATABASE_URL`` through the pooler and ``CAIRN_DATABASE_DIRECT_URL`` straight to
the server. A task, a schedule's fire and a two-node workflow run go through; afterwards
the database holds them succeeded, the pooler carried the request pools' transactions, and
only the direct sessions (LISTEN, the leaders' locks, the group commit's writer) reached the
server around it.

Skipped where pgbouncer is not installed, unless ``CAIRN_REQUIRE_DEPLOY=1`` (``.ci/run``,
which installs it): then it fails, as the deployment test does."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from libs.common import database
from libs.common.settings import CairnSettings, libpq_url
from services.core.db.feed import LISTENER_NAME
from tests.support import (
    SH_SHA,
    free_port,
    make_token,
    spawn_service,
    spawn_worker,
    spec,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.slow

PGBOUNCER = Path("/usr/sbin/pgbouncer")
DIRECT = "cairn-direct"  # the application_name of every connection that bypasses the pooler
POOLED = "cairn-pooled"


def _require_pgbouncer() -> None:
    if PGBOUNCER.exists():
        return
    reason = f"needs {PGBOUNCER} (apt-get install pgbouncer)"
    if os.environ.get("CAIRN_REQUIRE_DEPLOY") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


class Bouncer:
    """A PgBouncer child process in transaction mode in front of one database."""

    def __init__(self, server_url: str, folder: Path) -> None:
        url = make_url(server_url)
        self.user, self.password, self.database = url.username, url.password, url.database
        self.port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "userlist.txt").write_text(f'"{self.user}" "{self.password}"\n')
        config = folder / "pgbouncer.ini"
        config.write_text(
            f"[databases]\n{self.database} = host={url.host} port={url.port}"
            f" dbname={self.database}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = scram-sha-256\nauth_file = {folder / 'userlist.txt'}\n"
            f"admin_users = {self.user}\n"
            "pool_mode = transaction\ndefault_pool_size = 20\nmax_client_conn = 500\n"
            # Each transaction on another server connection, where the default (the most
            # recently used) would mostly hand one client the same: a statement prepared
            # on one server connection is then missing on the next at once.
            "server_round_robin = 1\nmin_pool_size = 4\n"
        )
        self.log = folder / "pgbouncer.log"
        # PgBouncer refuses to run as root; it reads its files before it switches user.
        as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(PGBOUNCER), *as_user, str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(self._accepts, timeout=10, interval=0.05)

    def url(self, application_name: str) -> str:
        return (
            f"postgresql+psycopg://{self.user}:{self.password}@127.0.0.1:{self.port}"
            f"/{self.database}?application_name={application_name}"
        )

    def _accepts(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"pgbouncer exited: {self.log.read_text()}")
        try:
            self.show("VERSION")
        except psycopg.OperationalError:
            return False
        return True

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW what`` on the admin console (simple queries only: a client-side cursor)."""
        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            dbname="pgbouncer",
            user=self.user,
            password=self.password,
            autocommit=True,
            cursor_factory=psycopg.ClientCursor,
            prepare_threshold=None,
        ) as conn:
            cur = conn.execute(f"SHOW {what}")
            names = [c.name for c in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def stop(self) -> None:
        stop_process(self.proc)  # type: ignore[arg-type]


@pytest.fixture
def bouncer(db_url: str, tmp_path: Path) -> Iterator[Bouncer]:
    _require_pgbouncer()
    made = Bouncer(db_url, tmp_path / "pgbouncer")
    yield made
    made.stop()


def _with_name(url: str, application_name: str) -> str:
    return f"{url}?application_name={application_name}"


def _shell(script: str) -> dict[str, Any]:
    return {"artifact": {"uri": "file:///bin/sh", "sha256": SH_SHA}, "args": ["-c", script]}


def _start(bouncer: Bouncer, direct: str, tmp_path: Path) -> dict[str, Any]:
    """Core, dag, cron (on a clock running 30 times fast from the present, a minute's slot
    every two seconds) and a worker, each as a process; their URLs and processes."""
    pooled = bouncer.url(POOLED)
    urls: dict[str, Any] = {"procs": [], "logs": []}

    def serve(name: str, **env: str) -> None:
        port = free_port()
        env = {"CAIRN_DATABASE_DIRECT_URL": direct, **env}
        variable = f"CAIRN_{name.upper()}_PORT"
        module = f"services.{name}"
        log = tmp_path / f"{name}.log"
        urls["logs"].append(log)
        home = tmp_path / name
        urls["procs"].append(spawn_service(module, variable, pooled, home, port, log=log, **env))
        urls[name] = f"http://127.0.0.1:{port}"

    serve("core", CAIRN_PROMOTE_INTERVAL_S="0.1")
    service = {"CAIRN_URL": urls["core"], "CAIRN_TOKEN": make_token(direct, "svc", "service")}
    serve("dag", CAIRN_FEED_WAIT_S="1", **service)
    warp = f"{time.time()},{datetime.now(UTC).isoformat()},30"
    serve(
        "cron",
        CAIRN_DAG_URL=urls["dag"],
        CAIRN_CRON_LEAD_S="0",
        CAIRN_CRON_TICK_S="0.1",
        CAIRN_CRON_CLOCK_WARP=warp,
        **service,
    )
    target = SimpleNamespace(url=urls["core"], db_url=direct)
    urls["procs"].append(spawn_worker(target, tmp_path / "worker", "w1"))  # type: ignore[arg-type]
    return urls


def _get(http: httpx.Client, path: str) -> Any:
    answer = http.get(path)
    answer.raise_for_status()
    return answer.json()


def _sessions(direct: str, bouncer: Bouncer) -> tuple[list[Any], list[Any], int]:
    """The server's sessions of the test's database (not this one): those that bypassed
    the pooler and those it opened, as (application_name, advisory locks held in each of
    three looks 50 ms apart); and the transactions the pooler carried. A session's lock
    stays; a transaction's own (sharing, placement and notifications take one, which a
    pooler in transaction mode carries well) goes with its commit, and was once caught
    by a single look."""
    pooler_ports = {int(s["local_port"]) for s in bouncer.show("SERVERS")}
    held: dict[int, tuple[int, str, int]] = {}
    with psycopg.connect(libpq_url(direct), autocommit=True) as conn:
        for look in range(3):
            rows = conn.execute(
                "SELECT a.pid, a.client_port, a.application_name, (SELECT count(*)"
                "  FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory'"
                "  AND l.granted)"
                " FROM pg_stat_activity a WHERE a.datname = current_database()"
                " AND a.pid <> pg_backend_pid()"
            ).fetchall()
            seen = {pid: (port, name, locks) for pid, port, name, locks in rows}
            if look == 0:
                held = seen
            else:
                held = {
                    pid: (port, name, min(locks, seen[pid][2] if pid in seen else 0))
                    for pid, (port, name, locks) in held.items()
                }
            time.sleep(0.05)
    around = [(name, locks) for port, name, locks in held.values() if port not in pooler_ports]
    through = [(name, locks) for port, name, locks in held.values() if port in pooler_ports]
    stats = [s for s in bouncer.show("STATS") if s["database"] == bouncer.database]
    return around, through, int(stats[0]["total_xact_count"])


@pytest.mark.timeout(120)
def test_a_task_a_schedule_and_a_workflow_run_through_pgbouncer_in_transaction_mode(
    db_url: str, bouncer: Bouncer, tmp_path: Path
) -> None:
    direct = _with_name(db_url, DIRECT)
    started = _start(bouncer, direct, tmp_path)
    headers = {"Authorization": f"Bearer {make_token(direct, 'alice', 'user')}"}
    try:
        with (
            httpx.Client(base_url=started["core"], headers=headers, timeout=10) as core,
            httpx.Client(base_url=started["cron"], headers=headers, timeout=10) as cron,
            httpx.Client(base_url=started["dag"], headers=headers, timeout=10) as dag,
        ):
            task = core.post("/v1/tasks", json=spec(name="through")).json()["id"]
            schedule = cron.post(
                "/v1/schedules",
                json={
                    "name": "minutely",
                    "expression": "* * * * *",
                    "target": {"kind": "task", "task": {"name": "fired", **_shell("true")}},
                },
            )
            assert schedule.status_code == 201, schedule.text
            flow = {
                "name": "pair",
                "nodes": [
                    {"name": "first", "task": _shell("true"), "depends_on": []},
                    {"name": "second", "task": _shell("true"), "depends_on": ["first"]},
                ],
            }
            assert dag.post("/v1/workflows", json=flow).status_code in (200, 201)
            run = dag.post("/v1/workflows/pair/runs", json={}).json()["id"]

            wait_for(lambda: _get(core, f"/v1/tasks/{task}")["state"] == "succeeded", 30, 0.1)
            wait_for(lambda: _get(dag, f"/v1/runs/{run}")["state"] == "succeeded", 30, 0.2)
            fired = "SELECT count(*) FROM core.tasks WHERE name = 'fired' AND state = 'succeeded'"
            wait_for(lambda: _count(direct, fired) >= 1, 30, 0.2)

            around, through, transactions = _sessions(direct, bouncer)
            backends = asyncio.run(_repeat_through(bouncer.url(POOLED), direct))
            # What the services logged while it all went through (not their stopping).
            errors = [
                line
                for log in started["logs"]
                for line in log.read_text().splitlines()
                if '"level": "error"' in line or "Traceback" in line
            ]
    finally:
        for proc in reversed(started["procs"]):
            stop_process(proc, signal.SIGTERM)
    # Nothing failed on the way: a statement prepared on one server connection and run
    # on another ("prepared statement ... does not exist") is logged by the loop it broke.
    assert errors == [], errors[:3]
    # Every connection around the pooler is one of the direct ones: the leaders' locks
    # (core's, cron's and dag's) and the LISTEN sessions (core's names itself, so that
    # replicas count each other: ``feed.LISTENER_NAME``); none of the request pools' did.
    assert {name for name, _ in around} == {DIRECT, LISTENER_NAME}, around
    assert sum(locks for _, locks in around) == 3
    assert through and all(locks == 0 for _, locks in through)
    assert transactions >= 50, transactions
    assert len(set(backends)) > 1, backends  # one client, its transactions on several servers
    _check_what_the_database_holds(direct, task, run)


async def _repeat_through(pooled: str, direct: str) -> list[int]:
    """One connection of a pool made as the services make theirs, from the settings they
    read, runs one statement in 12 transactions (psycopg would prepare it after 5 by
    default); the backends that ran them."""
    settings = CairnSettings(database_url=pooled, database_direct_url=direct)
    assert settings.pooler == "transaction"
    engine = database.pool(settings.database_url or "", settings, pool_size=1, max_overflow=0)
    backends = []
    try:
        for _ in range(12):
            async with engine.begin() as conn:
                backends.append(int(await conn.scalar(text("SELECT pg_backend_pid()"))))
    finally:
        await engine.dispose()
    return backends


def _count(url: str, query: str) -> int:
    with psycopg.connect(libpq_url(url)) as conn:
        return int(conn.execute(query).fetchone()[0])  # type: ignore[index]


def _check_what_the_database_holds(direct: str, task: int, run: int) -> None:
    """The task, the first fire's task and both nodes' tasks succeeded, each by one
    attempt (a fire the stop caught in flight may be anywhere)."""
    with psycopg.connect(libpq_url(direct)) as db:
        tries = dict(
            db.execute(
                "SELECT t.id, array_agg(a.outcome ORDER BY a.id) FROM core.tasks t"
                " JOIN core.attempts a ON a.task_id = t.id WHERE t.state = 'succeeded'"
                " GROUP BY t.id"
            ).fetchall()
        )
        first_fire = db.execute(
            "SELECT outcome, task_id FROM cron.fires ORDER BY fire_time LIMIT 1"
        ).fetchone()
        assert first_fire is not None and first_fire[0] == "submitted"
        nodes = db.execute(
            "SELECT name, state, task_id FROM dag.nodes WHERE run_id = %s ORDER BY name", (run,)
        ).fetchall()
        assert [(name, state) for name, state, _ in nodes] == [
            ("first", "succeeded"),
            ("second", "succeeded"),
        ]
        run_state = db.execute("SELECT state FROM dag.runs WHERE id = %s", (run,)).fetchone()
    assert run_state == ("succeeded",)
    for done in (task, first_fire[1], *(node_task for *_, node_task in nodes)):
        assert tries.get(done) == ["succeeded"], (done, tries)
