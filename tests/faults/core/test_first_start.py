"""The embedded PostgreSQL's first start on a host that does not have its system user yet:
several processes starting their own servers at the same instant must all serve (this is
what `pytest -n 2`, or two `cairn up` on one host, do on a fresh machine)."""

from __future__ import annotations

import multiprocessing
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import psycopg
import pytest

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="creates a system user: needs root"),
]

STARTS = 4


def _known(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture
def fresh_user() -> Iterator[str]:
    """A system user name no host entry has; removed afterwards."""
    name = "cairn_t" + secrets.token_hex(4)
    assert not _known(name)
    yield name
    subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["groupdel", name], capture_output=True, check=False)


@pytest.fixture
def roots() -> Iterator[list[Path]]:
    # Outside pytest's temp root, which it keeps 0700 (the server's user must pass through).
    made = [Path(tempfile.mkdtemp(prefix="cairn-first-start-")) for _ in range(STARTS)]
    yield made
    for root in made:
        shutil.rmtree(root, ignore_errors=True)


def _start_at_once(root: str, user: str, barrier: Barrier, results: Any) -> None:
    server = EmbeddedPostgres(Path(root) / "pg", fast=True, system_user=user)
    barrier.wait(timeout=120)
    try:
        url = server.start()
        with psycopg.connect(libpq_url(url), connect_timeout=10) as conn:
            row = conn.execute("SELECT 1").fetchone()
        owner = (server.data).stat().st_uid
        results.put((root, "serving" if row == (1,) else f"answered {row}", owner))
    except Exception as exc:
        results.put((root, f"{type(exc).__name__}: {exc}", -1))
    finally:
        server.stop()


def test_first_starts_at_the_same_instant_all_serve(fresh_user: str, roots: list[Path]) -> None:
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(STARTS)
    results = spawn.Queue()
    procs = [
        spawn.Process(target=_start_at_once, args=(str(root), fresh_user, barrier, results))
        for root in roots
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=180) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    uid = pwd.getpwnam(fresh_user).pw_uid
    assert sorted(outcome for _, outcome, _ in outcomes) == ["serving"] * STARTS, outcomes
    assert {owner for _, _, owner in outcomes} == {uid}


def test_a_stale_pid_file_does_not_stop_the_next_start(fresh_user: str, roots: list[Path]) -> None:
    server = EmbeddedPostgres(roots[0] / "pg", fast=True, system_user=fresh_user)
    server.start()
    server.stop()
    # As after a crash and a reboot: the file names a pid that is now another process
    # of the same user as the server would be (here: ourselves, root).
    stale = f"{os.getpid()}\n{server.data}\n0\n5432\n\n127.0.0.1\n"
    (server.data / "postmaster.pid").write_text(stale)
    assert not server.running()
    try:
        url = server.start()
        with psycopg.connect(libpq_url(url), connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert server.running()
    finally:
        server.stop()
