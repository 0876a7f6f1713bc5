"""Teams: create, delete, members and the team's share, each audited in its transaction."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.models import OwnerUsage, ShareSettings, Team
from services.core.db import secrets, sharing, teams
from services.core.db.audit import Auditor
from services.core.domain.principals import Principal
from services.core.ops.sharing import share_of


async def create(
    engine: AsyncEngine, record: Auditor, name: str, by: str, reuse_name: bool = False
) -> Team:
    """The team; a deleted team's name only with ``reuse_name`` (its work still names
    it), which the audit row says."""
    async with engine.begin() as conn:
        reused = await teams.create(conn, name, by, reuse_name)
        team = await teams.get(conn, name)
        after = {**team.model_dump(), **({"reused_name": True} if reused else {})}
        await record(conn, "team.create", f"team:{team.name}", after=after)
    return team


async def delete(engine: AsyncEngine, record: Auditor, name: str, by: str) -> None:
    """The team, its memberships, claims and share, and its secrets (their names in the
    audit row): a team made later with the same name must not open the old one's values,
    which are sealed under the same scope. Its name is kept apart (``db.teams``)."""
    async with engine.begin() as conn:
        before = await teams.delete_team(conn, name, by)
        gone = await secrets.remove_all(conn, secrets.Scope(None, name))
        kept = {**before.model_dump(), "secrets": gone}
        await record(conn, "team.delete", f"team:{name}", before=kept)


async def add_member(engine: AsyncEngine, record: Auditor, name: str, member: str, by: str) -> Team:
    """Idempotent: audited only when the member was not in the team."""
    async with engine.begin() as conn:
        if await teams.add_member(conn, name, member, by):
            await record(conn, "team.member.add", f"team:{name}", after={"member": member})
        return await teams.get(conn, name)


async def remove_member(engine: AsyncEngine, record: Auditor, name: str, member: str) -> Team:
    async with engine.begin() as conn:
        await teams.remove_member(conn, name, member)
        await record(conn, "team.member.remove", f"team:{name}", before={"member": member})
        return await teams.get(conn, name)


async def set_share(
    engine: AsyncEngine, record: Auditor, book: sharing.Book, name: str, change: ShareSettings
) -> OwnerUsage:
    """The team's weight and quotas changed; every replica's book reads them anew."""
    async with engine.begin() as conn:
        await teams.get(conn, name)
        [before] = await sharing.team_usage_of(conn, [name])
        await sharing.set_share(conn, name, change, team=True)
        [after] = await sharing.team_usage_of(conn, [name])
        await record(
            conn,
            "team.share",
            f"team:{name}",
            before=share_of(before),
            after=share_of(after),
        )
    book.invalidate()
    return after


async def forget_claims(engine: AsyncEngine, kids: list[str]) -> int:
    """The identity provider withdrew these keys: the team claims their tokens vouched
    for are not trusted any more; how many went."""
    async with engine.begin() as conn:
        return await teams.forget_claims(conn, kids)


async def claims_seen(engine: AsyncEngine, principal: Principal) -> None:
    """A verified token of the provider: the teams it claims are kept (for leases until
    it expires, for what services do in its name while they stand), those it no longer
    claims forgotten."""
    if principal.claims_until is None or principal.claims_standing is None:
        return
    async with engine.begin() as conn:
        await teams.seen(
            conn,
            principal.name,
            principal.claimed,
            principal.claims_until,
            principal.claims_standing,
            principal.key_id,
        )
