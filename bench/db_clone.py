"""What a test's database costs: a clone of the migrated template, then its drop.

    .venv/bin/python bench/db_clone.py [--dir DIR] [--rounds 5] [--clones 20]

Every test that has a core clones the template the suite migrates once
(``tests/conftest.py``, ``fresh_database``) and drops the clone at its end. This starts
an embedded PostgreSQL with the tests' settings (``fast``) under ``DIR`` (by default the
folder the tests use, ``tests.conftest._in_memory``: ``/dev/shm`` when it is a tmpfs with
room), migrates a template as the tests do, and times rounds of ``--clones`` clones and
drops: the wall time of each statement and PostgreSQL's CPU (the postmaster's reaped
backends and its live children, ``fleet.pg_cpu_s``) a clone.

On a file system that checks new inodes against recently deleted ones (ext4 without a
journal: ``recently_deleted``, for 30 s) the rounds grow slower as the clones' files
churn; give ``--dir`` a folder on it to see that beside the tmpfs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the tests' own settings

from fleet import pg_cpu_s

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url
from tests.conftest import _cheap_password_check, _in_memory
from tests.support import MIGRATIONS

TEMPLATE = "bench_template"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clones", type=int, default=20)
    args = parser.parse_args()
    place = args.dir if args.dir is not None else _in_memory()
    root = Path(tempfile.mkdtemp(prefix="cairn-bench-clone-", dir=place))
    server = EmbeddedPostgres(root / "pg", fast=True)
    try:
        server.start()
        _cheap_password_check(server)
        admin = libpq_url(server.url)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {TEMPLATE}")
        for upgrade in MIGRATIONS:
            upgrade(server.url.rsplit("/", 1)[0] + "/" + TEMPLATE)
        postmaster = server.pid()
        assert postmaster is not None
        print(f"data in {root} ({shutil.disk_usage(root).total >> 30} GiB file system)")
        for round_no in range(1, args.rounds + 1):
            created = dropped = 0.0
            cpu = pg_cpu_s(postmaster)
            for clone in range(args.clones):
                name = f"clone_{round_no}_{clone}"
                with psycopg.connect(admin, autocommit=True) as conn:
                    began = time.perf_counter()
                    conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
                    middle = time.perf_counter()
                    conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
                    created += middle - began
                    dropped += time.perf_counter() - middle
            spent = pg_cpu_s(postmaster) - cpu
            n = args.clones
            print(
                f"round {round_no}: create {created / n * 1000:.1f} ms, drop"
                f" {dropped / n * 1000:.1f} ms, PostgreSQL's CPU {spent / n * 1000:.1f} ms a clone"
            )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
