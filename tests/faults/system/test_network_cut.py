"""A leader cut off from PostgreSQL without a word (its host lost power, a network cut: no
FIN, no RST ever reaches the server): nftables drops every packet of the leader's lock
session on loopback. The server must end that session by itself and free the advisory
lock, or no other replica could lead (cron firing nothing, workflows standing still)
until the kernel's two-hour keepalive; the cut-off leader must notice too and stop
leading. Both happen within seconds (``libs/common/database.keepalive``).

Confined to this test: an nftables table of its own (named by its pid), matching only
the lock session's own port, deleted afterwards."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from typing import Any

import psycopg
import pytest

from libs.common.leader import Elector, LeadershipLost
from services.dag.engine import _LEADER_KEY as DAG_KEY

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
