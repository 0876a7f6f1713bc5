"""A leader cut off from PostgreSQL without a word (its host lost power, a network cut: no
FIN, no RST ever reaches the server): nftables drops every packet of the leader's lock
session on loopback. The server must end that session by itself and free the advisory
lock, or no other replica could lead (cron firing nothing, workflows standing still)
until the kernel's two-hour keepalive; the cut-off leader must notice too and stop
leading. Both happen within seconds (``libs/common/database.keepalive``). The same for a
migrating replica cut off while its index build waits: its session holds the migrations'
advisory lock, behind which every other replica's start waits.

Confined to this test: an nftables table of its own (named by its pid), matching only
the lock session's own port, deleted afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from libs.common.leader import Elector, LeadershipLost
from libs.common.locks import MIGRATIONS
from libs.common.settings import libpq_url
from services.dag.engine import _LEADER_KEY as DAG_KEY
from tests.support.migration_locks import ROOT, SCHEMAS, migration_env, reaped, wait_for, waiting_on

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="nftables rules need root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) is not installed"),
]

#: keepalive idle + interval x count is 9 s; with the campaign's poll and a loaded host
BOUND_S = 25.0


def _nft(*args: str) -> None:
    subprocess.run(["nft", *args], check=True, capture_output=True, timeout=10)


def _local_port(conn: psycopg.AsyncConnection[Any]) -> int:
    with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
        return int(sock.getsockname()[1])


def test_a_leader_cut_off_without_a_word_frees_the_lead_within_seconds(db_url: str) -> None:
    table = f"cairn_partition_{os.getpid()}"

    async def scenario() -> None:
        cut = Elector(db_url, name="dag", key=DAG_KEY, table="dag.leader", poll_s=0.1)
        other = Elector(db_url, name="dag", key=DAG_KEY, table="dag.leader", poll_s=0.1)
        old = await cut.campaign()
        port = _local_port(old.conn)
        contender = asyncio.create_task(other.campaign())
        await asyncio.sleep(0.3)
        assert not contender.done()  # one leader at a time
        _nft("add", "table", "inet", table)
        _nft(
            "add", "chain", "inet", table, "out",
            "{ type filter hook output priority 0 ; policy accept ; }",
        )  # fmt: skip
        _nft("add", "rule", "inet", table, "out", "tcp", "sport", str(port), "drop")
        _nft("add", "rule", "inet", table, "out", "tcp", "dport", str(port), "drop")
        began = time.monotonic()
        try:
            new = await asyncio.wait_for(contender, BOUND_S)
            took = time.monotonic() - began
            assert new.epoch == old.epoch + 1
            # The cut-off leader knows too: its check fails (its keepalives, or the
            # check's own timeout), so it stops turning.
            with pytest.raises((LeadershipLost, psycopg.Error, TimeoutError)):
                await old.check()
            await new.close()
        finally:
            _nft("delete", "table", "inet", table)
            await old.close()
        assert took < BOUND_S

    asyncio.run(scenario())


@contextlib.contextmanager
def _dropped(table: str, ports: set[int]) -> Iterator[None]:
    """Every packet to or from ``ports`` dropped (an nftables table of this test's own,
    deleted after)."""
    _nft("add", "table", "inet", table)
    try:
        _nft(
            "add", "chain", "inet", table, "out",
            "{ type filter hook output priority 0 ; policy accept ; }",
        )  # fmt: skip
        for port in ports:
            _nft("add", "rule", "inet", table, "out", "tcp", "sport", str(port), "drop")
            _nft("add", "rule", "inet", table, "out", "tcp", "dport", str(port), "drop")
        yield
    finally:
        _nft("delete", "table", "inet", table)


@contextlib.contextmanager
def _migration_behind_a_report(
    db_url: str, stderr: int
) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any], subprocess.Popen[str]]]:
    """Core's next migration (it builds indexes concurrently) run as a process of its own,
    its build waiting behind an open "report" transaction: the report, a watching
    connection and the run (reaped after)."""
    SCHEMAS["core"].back(db_url)
    with (
        psycopg.connect(libpq_url(db_url), application_name="report") as report,
        psycopg.connect(libpq_url(db_url), autocommit=True) as watch,
    ):
        report.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        report.execute("SELECT count(*) FROM core.workers")
        run = subprocess.Popen(
            [sys.executable, "-c", "import sys; from services.core import migrate;"
             " migrate.upgrade(sys.argv[1])", db_url],
            env=migration_env(attempts=1, backoff_s=0.05),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )  # fmt: skip
        with reaped(run):
            wait_for(lambda: waiting_on(watch, report.info.backend_pid), "the build waited")
            yield report, watch, run
        report.rollback()


def test_a_migration_cut_off_without_a_word_frees_the_migration_lock_within_seconds(
    db_url: str,
) -> None:
    """A migrating replica cut off while its index build waits for a report (its host
    lost power: no FIN ever reaches the server). Its session holds the migrations'
    advisory lock, behind which every other replica's migrations (and so its start)
    wait: the server must end it within seconds, as a leader's, not at the kernel's
    two-hour keepalive (``client_connection_check_interval`` alone sees only a FIN)."""
    table = f"cairn_migration_cut_{os.getpid()}"
    with _migration_behind_a_report(db_url, subprocess.DEVNULL) as (report, watch, run):
        [(session, port)] = watch.execute(
            "SELECT pid, client_port FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            (report.info.backend_pid,),
        ).fetchall()
        with _dropped(table, {port}):
            run.kill()  # its FIN, like all else on that connection, never arrives
            run.wait()
            alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
            wait_for(
                lambda: watch.execute(alive, (session,)).fetchone() == (0,),
                "the cut-off run's session ended",
                timeout_s=BOUND_S,
            )
        # The lock went with it: the next run takes it at once.
        held = watch.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = %s",
            (MIGRATIONS & 0xFFFF_FFFF,),
        ).fetchone()
        assert held == (0,)


def _tcp_ports(pid: int) -> set[int]:
    """The local ports of the TCP connections process ``pid`` holds (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_migration_whose_server_vanishes_gives_up_within_seconds(db_url: str) -> None:
    """The server vanishes without a word (a failover, its host lost power) while a run's
    index build waits: every packet of the run's connections (its session's and its
    blockers' watch) is dropped from then on. The run gives up within seconds, its
    process exits and the deploy's restart can try the new server, instead of waiting
    on those connections for ever (its session's) or for the kernel's 15 minutes of
    retransmissions (the watch's query)."""
    table = f"cairn_migration_vanish_{os.getpid()}"
    with _migration_behind_a_report(db_url, subprocess.PIPE) as (_, _, run):
        ports = _tcp_ports(run.pid)
        assert len(ports) == 2  # the session and the watch
        with _dropped(table, ports):
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.wait(timeout=BOUND_S)
            assert run.returncode is not None, "the run still waits on a vanished server"
            _, err = run.communicate()
            assert run.returncode != 0, err
