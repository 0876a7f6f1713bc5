"""The database URL: one form for several hosts (a cluster that fails over) that SQLAlchemy
with psycopg and plain libpq both read the same way."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import make_url

from libs.common.settings import database_hosts, libpq_url, normalise_database_url

ONE_FORM = (
    "postgresql+psycopg://cairn:s%40cret@/cairn"
    "?host=127.0.0.1,127.0.0.1&port=5432,5433&target_session_attrs=read-write&connect_timeout=5"
)


@pytest.mark.parametrize(
    "given",
    [
        # libpq's own form
        "postgresql://cairn:s%40cret@127.0.0.1:5432,127.0.0.1:5433/cairn"
        "?target_session_attrs=read-write",
        # SQLAlchemy's form, which libpq cannot read
        "postgresql+psycopg://cairn:s%40cret@/cairn"
        "?host=127.0.0.1:5432&host=127.0.0.1:5433&target_session_attrs=read-write",
        # the one form, but psycopg would give a dead host 130 s before it tries the next
        ONE_FORM.removesuffix("&connect_timeout=5"),
        ONE_FORM,
    ],
    ids=["libpq", "sqlalchemy", "no-timeout", "normalised"],
)
def test_several_hosts_become_the_one_form(given: str) -> None:
    assert normalise_database_url(given) == ONE_FORM


def test_sqlalchemy_and_libpq_read_the_same_hosts_ports_and_attributes() -> None:
    _, sqlalchemy_args = PGDialect_psycopg().create_connect_args(make_url(ONE_FORM))
    libpq_args = psycopg.conninfo.conninfo_to_dict(libpq_url(ONE_FORM))
    for args in (sqlalchemy_args, libpq_args):
        assert args["host"] == "127.0.0.1,127.0.0.1"
        assert str(args["port"]) == "5432,5433"
        assert args["target_session_attrs"] == "read-write"
        assert args["user"] == "cairn" and args["password"] == "s@cret"
        assert args["dbname"] == "cairn"
        assert str(args["connect_timeout"]) == "5"


@pytest.mark.parametrize(
    "given",
    [
        "postgresql+psycopg://cairn:pw@db.internal:5432/cairn?sslmode=require",
        "postgresql+psycopg://cairn:pw@/cairn?host=/var/run/postgresql",
        "postgresql+psycopg://cairn@/cairn?host=::1,::2&port=5432,5433&connect_timeout=2",
    ],
)
def test_other_urls_keep_their_form(given: str) -> None:
    assert normalise_database_url(given) == given


def test_the_scheme_names_the_psycopg_driver() -> None:
    assert normalise_database_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    with pytest.raises(ValueError, match="PostgreSQL URL"):
        normalise_database_url("mysql://u@h/db")


def test_every_host_is_listed_for_the_egress_guard() -> None:
    assert database_hosts(ONE_FORM) == [("127.0.0.1", 5432), ("127.0.0.1", 5433)]
    assert database_hosts("postgresql+psycopg://u@db:6432/x") == [("db", 6432)]
    six = normalise_database_url("postgresql://u@[::1]:5432,[::2]/x")
    assert six == "postgresql+psycopg://u@/x?host=::1,::2&port=5432,&connect_timeout=5"
    assert database_hosts(six) == [("::1", 5432), ("::2", None)]


def test_a_connect_timeout_the_url_sets_is_kept() -> None:
    given = "postgresql://u@a:1,b:2/db?connect_timeout=20"
    assert (
        normalise_database_url(given)
        == "postgresql+psycopg://u@/db?host=a,b&port=1,2&connect_timeout=20"
    )


@pytest.mark.parametrize(
    "given",
    [
        "postgresql://u@a:1,b:2/db?host=c",  # hosts in two places
        "postgresql://u@a:x,b:2/db",  # not a port
        "postgresql://u@/db?host=a:1&host=b:2&port=3",  # two ways of naming ports
    ],
)
def test_ambiguous_urls_are_refused(given: str) -> None:
    with pytest.raises(ValueError):
        normalise_database_url(given)
