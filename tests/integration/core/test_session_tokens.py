"""Session tokens against the real database (docs/security.md, "Signing in"): the
stretches a token lives in, its bound at the session's end, and its end with the session.
Minting over HTTP and its use against real cron and dag is in test_login.py."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.errors import Unauthorized
from services.core.db import login as login_db
from services.core.ops import login
from tests.support import with_engine

COOKIE = "the-session-cookie"


async def _session(engine: AsyncEngine, lifetime_s: float, cookie: str = COOKIE) -> None:
    async with engine.begin() as conn:
        await login_db.create_session(
            conn, cookie, "csrf", "alice", "user", frozenset({"sre"}), None, lifetime_s
        )


def test_a_stretch_has_one_token_that_lives_to_the_end_of_the_next(db_url: str, db: Any) -> None:
    start = (time.time() // 150 + 1) * 150  # a stretch's first second (lifetime 300 s)

    async def work(engine: AsyncEngine) -> None:
        await _session(engine, 3600)
        first, until = await login.session_token(engine, COOKIE, 300, now=start + 1)
        again, same = await login.session_token(engine, COOKIE, 300, now=start + 149)
        assert (again, same) == (first, until)
        assert until == datetime.fromtimestamp(start + 300, UTC)
        later, after = await login.session_token(engine, COOKIE, 300, now=start + 150)
        assert later != first and after == until + timedelta(seconds=150)
        await _session(engine, 3600, "another-cookie")
        theirs, _ = await login.session_token(engine, "another-cookie", 300, now=start + 1)
        assert theirs != first  # derived from the session's own cookie
        me = await login.token_principal(engine, first)
        assert me is not None and me.name == "alice" and me.teams == {"sre"}
        assert me.claimed == {"sre"} and me.expires_at == until

    with_engine(db_url, work)
    assert db.execute("SELECT count(*) FROM core.session_tokens").fetchone()[0] == 3


def test_a_token_never_outlives_its_session_and_ends_with_it(db_url: str, db: Any) -> None:
    async def work(engine: AsyncEngine) -> None:
        await _session(engine, 60)
        token, until = await login.session_token(engine, COOKIE, 3600)
        async with engine.connect() as conn:
            session = await login_db.get_session(conn, COOKIE)
        assert session is not None and until == session.expires_at
        async with engine.begin() as conn:
            await login_db.end_session(conn, COOKIE)
        assert await login.token_principal(engine, token) is None
        with pytest.raises(Unauthorized, match="sign in again"):
            await login.session_token(engine, COOKIE, 3600)

    with_engine(db_url, work)
    assert db.execute("SELECT count(*) FROM core.session_tokens").fetchone()[0] == 0
