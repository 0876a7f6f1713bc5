"""The dashboard's sign-ins under way and its sessions. Neither the state of a flow nor a
session's cookie or CSRF token is stored: only their SHA-256, so a copy of the table
signs no one in."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db.tables import login_flows, session_tokens, sessions
from services.core.db.workers import lease_digest

#: how long a sign-in may take at the provider
FLOW_MAX_S = 600


@dataclass(frozen=True)
class Flow:
    verifier: str
    nonce: str
    next: str


@dataclass(frozen=True)
class Session:
    principal: str
    role: str
    teams: frozenset[str]
    kid: str | None
    csrf_hash: str
    expires_at: datetime


async def start_flow(
    conn: AsyncConnection, state: str, verifier: str, nonce: str, next_: str
) -> None:
    """Keep a flow until its state comes back; flows older than ``FLOW_MAX_S`` go."""
    await conn.execute(
        delete(login_flows).where(
            login_flows.c.created_at < func.now() - text(f"interval '{FLOW_MAX_S} seconds'")
        )
    )
    await conn.execute(
        insert(login_flows).values(
            state_hash=lease_digest(state), verifier=verifier, nonce=nonce, next=next_
        )
    )


async def take_flow(conn: AsyncConnection, state: str) -> Flow | None:
    """The flow of ``state``, once (it is deleted), if it began within ``FLOW_MAX_S``."""
    row = (
        await conn.execute(
            delete(login_flows)
            .where(login_flows.c.state_hash == lease_digest(state))
            .returning(
                login_flows.c.verifier,
                login_flows.c.nonce,
                login_flows.c.next,
                (login_flows.c.created_at > func.now() - text(f"interval '{FLOW_MAX_S} seconds'")),
            )
        )
    ).first()
    if row is None or not row[3]:
        return None
    return Flow(row.verifier, row.nonce, row.next)


async def create_session(
    conn: AsyncConnection,
    session_id: str,
    csrf: str,
    principal: str,
    role: str,
    teams: frozenset[str],
    kid: str | None,
    lifetime_s: float,
) -> datetime:
    """Store a session (and drop those that have ended); when it ends."""
    await conn.execute(delete(sessions).where(sessions.c.expires_at <= func.now()))
    ends: datetime = (
        await conn.execute(
            insert(sessions)
            .values(
                id_hash=lease_digest(session_id),
                csrf_hash=lease_digest(csrf),
                principal=principal,
                role=role,
                teams=sorted(teams),
                kid=kid,
                expires_at=func.now() + text(f"make_interval(secs => {float(lifetime_s)})"),
            )
            .returning(sessions.c.expires_at)
        )
    ).scalar_one()
    return ends


def _session(row: Any) -> Session:
    return Session(
        principal=row.principal,
        role=row.role,
        teams=frozenset(row.teams),
        kid=row.kid,
        csrf_hash=row.csrf_hash,
        expires_at=row.expires_at,
    )


async def get_session(conn: AsyncConnection, session_id: str) -> Session | None:
    """The live session of this cookie, if any."""
    row = (
        await conn.execute(
            select(sessions).where(
                sessions.c.id_hash == lease_digest(session_id), sessions.c.expires_at > func.now()
            )
        )
    ).first()
    return None if row is None else _session(row)


_KEEP_TOKEN = text("""
INSERT INTO core.session_tokens (token_hash, session_hash, expires_at)
SELECT :token_hash, s.id_hash, least(:until, s.expires_at)
FROM core.sessions s WHERE s.id_hash = :session_hash AND s.expires_at > now()
ON CONFLICT (token_hash) DO UPDATE SET expires_at = core.session_tokens.expires_at
RETURNING expires_at
""")

_TOKEN_SESSION = text("""
SELECT s.principal, s.role, s.teams, s.kid, s.csrf_hash,
       least(t.expires_at, s.expires_at) AS expires_at
FROM core.session_tokens t JOIN core.sessions s ON s.id_hash = t.session_hash
WHERE t.token_hash = :token_hash AND t.expires_at > now() AND s.expires_at > now()
""")


async def keep_token(
    conn: AsyncConnection, session_id: str, token: str, until: datetime
) -> datetime | None:
    """Bind ``token`` to the live session of ``session_id`` until ``until`` (never past the
    session's end; a token kept already keeps its expiry): when it expires, or None when
    the session has ended. Expired tokens go."""
    await conn.execute(delete(session_tokens).where(session_tokens.c.expires_at <= func.now()))
    found = await conn.execute(
        _KEEP_TOKEN,
        {
            "token_hash": lease_digest(token),
            "session_hash": lease_digest(session_id),
            "until": until,
        },
    )
    ends: datetime | None = found.scalar_one_or_none()
    return ends


async def token_session(conn: AsyncConnection, token: str) -> Session | None:
    """The live session a live session token was minted for (its expiry the sooner of
    the two), if any."""
    row = (await conn.execute(_TOKEN_SESSION, {"token_hash": lease_digest(token)})).first()
    return None if row is None else _session(row)


async def end_session(conn: AsyncConnection, session_id: str) -> bool:
    gone = await conn.execute(
        delete(sessions).where(sessions.c.id_hash == lease_digest(session_id))
    )
    return bool(gone.rowcount)


async def end_sessions_of_keys(conn: AsyncConnection, kids: list[str]) -> int:
    gone = await conn.execute(
        delete(sessions).where(sessions.c.kid.is_(None) | sessions.c.kid.in_(sorted(kids)))
    )
    return gone.rowcount
