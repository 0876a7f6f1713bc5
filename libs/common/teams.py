"""Team ownership of schedules and workflows (docs/security.md, "Teams"): the rules the
cron and DAG services share. A team-owned schedule or workflow is seen and acted on by
the team's members; the tasks it submits to core are owned by its owner and the team."""

from __future__ import annotations

from libs.common.auth import Caller
from libs.common.errors import Forbidden, InvalidInput
from libs.common.models import SecretRef, TaskCreate


def _field_error(error: type[InvalidInput] | type[Forbidden], field: str, reason: str) -> Exception:
    return error(f"{field}: {reason}", errors=[{"field": field, "reason": reason}])


def check_member(caller: Caller, team: str | None, field: str) -> None:
    """Only a member gives work to a team (403 naming ``field``): core will submit the
    work's tasks for the owner's team, and refuses them unless the owner belongs to it."""
    if team is not None and team not in caller.teams:
        raise _field_error(Forbidden, field, f"you are not a member of team {team}")


def check_team_change(caller: Caller, owner: str, team: str | None, field: str) -> None:
    """Only its owner moves work to a team or takes it back (403 naming ``field``), and
    only to a team the owner belongs to: core submits its tasks for the owner's team."""
    if caller.name != owner:
        reason = f"only its owner, {owner}, may give it to a team or take it back"
        raise _field_error(Forbidden, field, reason)
    check_member(caller, team, field)


def check_what_runs(caller: Caller, owner: str, field: str) -> None:
    """Only its owner or an admin changes what a schedule or workflow runs (403 naming
    ``field``): its tasks run as its owner, so a teammate who chose their arguments would
    run them as someone else, past the queue policy that holds them."""
    if caller.name != owner and caller.role != "admin":
        reason = f"only its owner, {owner}, or an admin may change what it runs"
        raise _field_error(Forbidden, field, reason)


def bound_to_team(task: TaskCreate, team: str, field: str) -> TaskCreate:
    """``task`` as a team's schedule or workflow submits it: owned by ``team`` too (a
    different ``team`` is a 422 naming ``field.team``), and with no secret but the team's
    (any member may trigger or change it, so it must not reach its owner's own secrets:
    a 422 naming ``field.env.NAME``)."""
    if task.team not in (None, team):
        raise _field_error(
            InvalidInput, f"{field}.team", f"must be {team}, the team that owns it, or left out"
        )
    for name, value in task.env.items():
        if isinstance(value, SecretRef) and value.team != team:
            reason = f"a team's work may use only the team's secrets: add team {team!r}"
            raise _field_error(InvalidInput, f"{field}.env.{name}", reason)
    return task.model_copy(update={"team": team})
