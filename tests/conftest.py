"""A real PostgreSQL for the tests: one embedded server per test process, a template
database migrated once, and a fresh clone of it for every test."""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx._transports.default as httpx_transports
import psycopg
import pytest
import respx.mocks
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url

# The fixtures of cron's, dag's, the fault and the log store tests, wherever a test of them
# sits.
from tests.fixtures.cron import clock, cron  # noqa: F401
from tests.fixtures.dag import dag, runner, worker  # noqa: F401
from tests.fixtures.faults import workers  # noqa: F401
from tests.fixtures.logs import s3  # noqa: F401
from tests.support import MIGRATIONS, Core, fresh_database, start_core

# The longest tests (minutes each, mostly waiting on processes and faults) start first, so
# the two xdist workers run them side by side with the short ones after, instead of one
# worker finishing alone on them at the end (make test runs -n 2).
_LONGEST = (
    "tests/faults/core/test_jepsen.py",
    "tests/faults/system/test_jepsen_flows.py",
    "tests/faults/worker/test_partition.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        if path in _LONGEST:
            return _LONGEST.index(path)
        return len(_LONGEST) + (0 if item.get_closest_marker("slow") else 1)

    items.sort(key=rank)  # stable: the order within each rank is kept


# Every httpx client makes its TLS context anew from certifi's bundle (20-40 ms of CPU):
# the tests make thousands (each Core.client and httpx.get, each CLI run). A client with
# httpx's defaults gets one context a process instead, with the same checks (a client
# given its own verify= or cert= still makes its own).
_make_context = httpx_transports.create_ssl_context
_contexts: dict[tuple[str | None, str | None], ssl.SSLContext] = {}


def _shared_context(
    verify: ssl.SSLContext | str | bool = True, cert: Any = None, trust_env: bool = True
) -> ssl.SSLContext:
    if verify is not True or cert is not None:
        return _make_context(verify=verify, cert=cert, trust_env=trust_env)
    env = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    key = env if trust_env else (None, None)
    if key not in _contexts:
        _contexts[key] = _make_context(verify=True, cert=None, trust_env=trust_env)
    return _contexts[key]


httpx_transports.create_ssl_context = _shared_context

# Cairn's clients of its services send through a transport of their own
# (libs/common/transport.py), not httpcore's pool, which respx patches by default: mocked,
# their requests are caught where httpx's client picks its transport (the same routes).
respx.mocks.DEFAULT_MOCKER = "httpx"


TEMPLATE = "cairn_template"


#: where the tests' PostgreSQL keeps its files when that is a tmpfs with room
MEMORY_DIR = Path("/dev/shm")
#: the room it must have: a server's WAL stays at two segments (every DROP DATABASE asks
#: for a checkpoint), its databases at about 10 MB each and a few at a time
MEMORY_DIR_FREE_MB = 2048


def _in_memory() -> Path | None:
    """``MEMORY_DIR`` if it is a tmpfs with room. Each test clones the migrated template
    (about 600 files) and drops the clone; on this machine's ext4, which has no journal,
    every new inode is checked against the recently deleted ones (``recently_deleted``,
    for 30 s): under that churn a clone's PostgreSQL CPU rose from 84.5 to 238 ms in four
    rounds of 20, against a steady 44.5-48 on a tmpfs (``bench/db_clone.py``)."""
    try:
        room = os.statvfs(MEMORY_DIR)
        with open("/proc/self/mounts") as mounts:
            tmpfs = any(line.split()[1:3] == [str(MEMORY_DIR), "tmpfs"] for line in mounts)
    except OSError:
        return None
    enough = room.f_bavail * room.f_frsize >= MEMORY_DIR_FREE_MB << 20
    return MEMORY_DIR if tmpfs and enough else None


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedPostgres]:
    root = Path(tempfile.mkdtemp(prefix="cairn-test-pg-", dir=_in_memory()))
    server = EmbeddedPostgres(root / "pg", fast=True)
    server.start()
    _cheap_password_check(server)
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


def _cheap_password_check(server: EmbeddedPostgres) -> None:
    """The tests' server keeps its password, hashed with one SCRAM iteration instead of
    4096: each connection's client derives its key with that many (3 ms of CPU of 4 a
    connection, 7 ms of wall), and a test with core makes about 16."""
    admin = libpq_url(server.url)
    password = conninfo_to_dict(admin)["password"]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SET scram_iterations = 1")
        conn.execute(sql.SQL("ALTER ROLE CURRENT_USER PASSWORD {}").format(sql.Literal(password)))


def _with_database(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def template_db(pg_server: EmbeddedPostgres) -> str:
    admin = libpq_url(pg_server.url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE}")
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    for upgrade in MIGRATIONS:
        upgrade(_with_database(pg_server.url, TEMPLATE))
    return TEMPLATE


@pytest.fixture
def db_url(pg_server: EmbeddedPostgres, template_db: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own."""
    with fresh_database(pg_server.url, template_db, "t_") as url:
        yield url


@pytest.fixture
def db(db_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain connection to the test's database, for asserting on what it holds."""
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        yield conn


@pytest.fixture
def core(db_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Core]:
    """Core in a thread over the test's database; with the settings of the test's
    ``pytest.mark.core(**settings)`` (or its module's ``pytestmark``), if any."""
    marker = request.node.get_closest_marker("core")
    server = start_core(db_url, tmp_path, **(marker.kwargs if marker else {}))
    yield server
    server.stop()
