"""Which Cairn teams an identity provider's groups grant: only what the operator wrote
down, a prefix (``CAIRN_OIDC_TEAM_PREFIX``) and a table (``CAIRN_OIDC_TEAM_MAP``). A
group is never a team by its name alone: whoever may create groups at the provider would
join any team, its secrets included, by naming a group like it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: a team's name, as ``libs.common.models.TeamName`` spells it
TEAM = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,63}$")
_GROUP = re.compile(r"^[^\x00-\x1f\x7f,=]{1,256}$")
MAX_ENTRIES = 1000


def parse_team_map(value: str) -> dict[str, str]:
    """``group=team,group2=team2`` as a dict; ``ValueError`` naming the entry that is not
    one (a group named twice included: which team it grants would be a guess)."""
    table: dict[str, str] = {}
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"at most {MAX_ENTRIES} entries")
    for entry in entries:
        group, sep, team = (part.strip() for part in entry.rpartition("="))
        if not sep or not _GROUP.match(group) or not TEAM.match(team):
            raise ValueError(f"{entry!r} is not group=team (a team is lower-case a-z0-9_.-)")
        if group in table:
            raise ValueError(f"group {group!r} is mapped twice")
        table[group] = team
    return table


@dataclass(frozen=True)
class TeamMapping:
    """The teams a list of provider groups grants: a group in the table grants its
    team; a group that starts with the prefix grants the team named by the rest (when it
    is a team's name). Anything else grants nothing; with neither set, nothing does."""

    prefix: str | None = None
    table: Mapping[str, str] = field(default_factory=dict)

    @property
    def grants_any(self) -> bool:
        return bool(self.prefix) or bool(self.table)

    def teams(self, groups: Iterable[object]) -> frozenset[str]:
        found: set[str] = set()
        for group in groups:
            if not isinstance(group, str):
                continue
            if group in self.table:
                found.add(self.table[group])
            if self.prefix and group.startswith(self.prefix):
                name = group[len(self.prefix) :]
                if TEAM.match(name):
                    found.add(name)
        return frozenset(found)
