"""Teams: named groups of principals, managed by admins (or asserted per request by an
identity provider's claim). A task owned by a team is seen and acted on by its members."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.errors import Conflict, NotFound
from libs.common.models import Team
from services.core.db.tables import retired_teams, team_claims, team_members, teams


def _team(row: Any) -> Team:
    return Team(
        name=row.name,
        members=sorted(m for m in row.members if m is not None),
        created_at=row.created_at,
        created_by=row.created_by,
    )


def _query() -> Any:
    return (
        select(
            teams.c.name,
            teams.c.created_at,
            teams.c.created_by,
            func.array_agg(team_members.c.member).label("members"),
        )
        .select_from(teams.outerjoin(team_members, team_members.c.team == teams.c.name))
        .group_by(teams.c.name)
        .order_by(teams.c.name)
    )


async def create(conn: AsyncConnection, name: str, by: str, reuse_name: bool = False) -> bool:
    """Make the team; a name of a deleted team only with ``reuse_name`` (a 409 naming
    ``name`` otherwise). Returns whether it was such a name."""
    made = await conn.execute(
        pg_insert(teams)
        .values(name=name, created_by=by)
        .on_conflict_do_nothing()
        .returning(teams.c.name)
    )
    if made.first() is None:
        raise Conflict(f"team {name!r} exists already")
    retired = (
        await conn.execute(
            delete(retired_teams)
            .where(retired_teams.c.name == name)
            .returning(retired_teams.c.deleted_at)
        )
    ).first()
    if retired is not None and not reuse_name:
        day = retired.deleted_at.date().isoformat()
        raise Conflict(
            f"name: team {name!r} was deleted on {day} and its tasks, schedules and "
            "workflows still name it; a team made with this name would show them to its "
            "members: choose another name, or give reuse_name to take them on",
            errors=[{"field": "body.name", "reason": f"a deleted team's (on {day})"}],
        )
    return retired is not None


async def get(conn: AsyncConnection, name: str, member: str | None = None) -> Team:
    """The team; with ``member``, only if that principal belongs to it (else 404)."""
    row = (await conn.execute(_query().where(teams.c.name == name))).first()
    if row is None or (member is not None and member not in row.members):
        raise NotFound(f"team {name!r} not found")
    return _team(row)


async def list_(conn: AsyncConnection, member: str | None) -> list[Team]:
    """Every team, or those ``member`` belongs to."""
    query = _query()
    if member is not None:
        mine = select(team_members.c.team).where(team_members.c.member == member)
        query = query.where(teams.c.name.in_(mine))
    return [_team(row) for row in await conn.execute(query)]


async def delete_team(conn: AsyncConnection, name: str, by: str) -> Team:
    """Delete the team; its name is kept apart (``retired_teams``) until taken again."""
    before = await get(conn, name)
    await conn.execute(delete(teams).where(teams.c.name == name))
    await conn.execute(
        pg_insert(retired_teams)
        .values(name=name, deleted_by=by)
        .on_conflict_do_update(
            index_elements=[retired_teams.c.name],
            set_={"deleted_at": func.now(), "deleted_by": by},
        )
    )
    return before


async def add_member(conn: AsyncConnection, name: str, member: str, by: str) -> bool:
    """Add ``member``; False if it was one already."""
    await get(conn, name)
    added = await conn.execute(
        pg_insert(team_members)
        .values(team=name, member=member, added_by=by)
        .on_conflict_do_nothing()
        .returning(team_members.c.member)
    )
    return added.first() is not None


async def remove_member(conn: AsyncConnection, name: str, member: str) -> None:
    """Remove ``member``, also what an identity provider's claim vouched for (until its
    next submission with a token that still carries the claim)."""
    await get(conn, name)
    vouched = await conn.execute(
        delete(team_claims).where(team_claims.c.team == name, team_claims.c.member == member)
    )
    gone = await conn.execute(
        delete(team_members).where(team_members.c.team == name, team_members.c.member == member)
    )
    if not gone.rowcount and not vouched.rowcount:
        raise NotFound(f"{member!r} is not a member of team {name!r}")


# The token's word is the latest: its teams kept until ``Principal.claims_until``, what an earlier token claimed and this one does not forgotten.
_VOUCH = text("""
WITH dropped AS (
    DELETE FROM core.team_claims
    WHERE member = :member AND team <> ALL(CAST(:claimed AS text[]))
)
INSERT INTO core.team_claims (team, member, until, kid)
SELECT t.name, :member, :until, :kid
FROM core.teams t WHERE t.name = ANY(CAST(:teams AS text[]))
ON CONFLICT (team, member) DO UPDATE SET until = EXCLUDED.until, kid = EXCLUDED.kid
""")


def held_teams(member: str) -> str:
    """SQL: the teams the principal named by the SQL expression ``member`` belongs to when
    no token is at hand (a lease, a service acting for it): those an admin recorded, and
    those an identity provider's claim vouched for until its token expires."""
    return (
        f"SELECT m.team FROM core.team_members m WHERE m.member = {member} "
        f"UNION SELECT c.team FROM core.team_claims c WHERE c.member = {member} "
        "AND c.until > now()"
    )


async def teams_of(conn: AsyncConnection, member: str) -> frozenset[str]:
    """The teams ``member`` holds without a token at hand (``held_teams``)."""
    rows = await conn.execute(text(held_teams(":member")), {"member": member})
    return frozenset(row.team for row in rows)


async def recorded_teams(conn: AsyncConnection, member: str) -> frozenset[str]:
    """The teams an admin recorded ``member`` in: what a token's own claim adds to (a
    claim that an earlier token vouched for is not this token's word)."""
    rows = await conn.execute(select(team_members.c.team).where(team_members.c.member == member))
    return frozenset(row.team for row in rows)


async def vouch(
    conn: AsyncConnection,
    member: str,
    used: Iterable[str],
    claimed: Iterable[str],
    until: datetime,
    kid: str | None,
) -> None:
    """Keep the ``used`` teams that an identity provider's token (signed with key ``kid``,
    claiming ``claimed``) gives ``member`` until ``until``, so that a lease, which has no
    token, can check them; forget those it no longer claims. A team that does not exist is
    passed over."""
    await conn.execute(
        _VOUCH,
        {
            "member": member,
            "teams": sorted(used),
            "claimed": sorted(claimed),
            "until": until,
            "kid": kid,
        },
    )


async def forget_claims(conn: AsyncConnection, kids: Iterable[str]) -> int:
    """Forget what tokens signed with the withdrawn keys ``kids`` vouched for (and claims
    whose key is not known); how many."""
    gone = await conn.execute(
        delete(team_claims).where(team_claims.c.kid.is_(None) | team_claims.c.kid.in_(sorted(kids)))
    )
    return gone.rowcount


# A verified token's claim, seen now: each claimed team that exists is kept (its lease
# bound ``until`` never shortened), stands for services until ``standing``; the claims
# this token no longer makes are forgotten at once.
_SEEN = text("""
WITH dropped AS (
    DELETE FROM core.team_claims
    WHERE member = :member AND team <> ALL(CAST(:claimed AS text[]))
)
INSERT INTO core.team_claims (team, member, until, kid, seen_at, standing_until)
SELECT t.name, :member, :until, :kid, now(), :standing
FROM core.teams t WHERE t.name = ANY(CAST(:claimed AS text[]))
ORDER BY t.name  -- one lock order: two requests with the same token wait, never deadlock
ON CONFLICT (team, member) DO UPDATE SET
    until = GREATEST(core.team_claims.until, EXCLUDED.until),
    kid = EXCLUDED.kid,
    seen_at = EXCLUDED.seen_at,
    standing_until = EXCLUDED.standing_until
""")


async def seen(
    conn: AsyncConnection,
    member: str,
    claimed: Iterable[str],
    until: datetime,
    standing: datetime,
    kid: str | None,
) -> None:
    """A verified token (signed with ``kid``) claims ``claimed`` for ``member`` now:
    keep them, standing for services until ``standing``, and forget those it does not
    claim (``vouch`` keeps what a submission used until ``until``)."""
    await conn.execute(
        _SEEN,
        {
            "member": member,
            "claimed": sorted(claimed),
            "until": until,
            "standing": standing,
            "kid": kid,
        },
    )


_STANDING = text("""
SELECT m.team FROM core.team_members m WHERE m.member = :member
UNION SELECT c.team FROM core.team_claims c
WHERE c.member = :member AND (c.until > now() OR c.standing_until > now())
""")

# What a service submits in a standing claim's name is leased under the same claim.
_STAND_FOR = text("""
UPDATE core.team_claims SET until = standing_until
WHERE member = :member AND team = ANY(CAST(:teams AS text[]))
  AND standing_until > now() AND until < standing_until
""")


async def standing_teams(conn: AsyncConnection, member: str) -> frozenset[str]:
    """The teams a service acting for ``member`` (a cron fire, a DAG node) finds it in:
    those an admin recorded, and those a verified token claimed within
    ``CAIRN_OIDC_CLAIM_SEEN_S`` (or still vouched for a lease)."""
    rows = await conn.execute(_STANDING, {"member": member})
    return frozenset(row.team for row in rows)


async def stand_for(conn: AsyncConnection, member: str, used: Iterable[str]) -> None:
    """A service submitted for ``member`` under its standing claims to ``used``: their
    leases are honoured while the claims stand."""
    await conn.execute(_STAND_FOR, {"member": member, "teams": sorted(used)})


async def claims_of(conn: AsyncConnection, member: str) -> dict[str, datetime]:
    """The teams ``member`` holds by a provider's claim, and until when each stands."""
    rows = await conn.execute(
        select(team_claims.c.team, func.greatest(team_claims.c.until, team_claims.c.standing_until))
        .where(team_claims.c.member == member)
        .where(func.greatest(team_claims.c.until, team_claims.c.standing_until) > func.now())
    )
    return {row[0]: row[1] for row in rows}
