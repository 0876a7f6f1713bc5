"""Secrets: named values of an owner or a team, sealed with ``crypto.SecretBox``. No read
of the API returns a value; core opens them only into the claim answer of the worker that
leases an attempt, and masks them in what that attempt's worker sends back.

A task refers to secrets in two places, under one set of rules (who may use which, checked
at submit, retry and every lease): its ``env`` values, and its artifact's ``credentials``
(``S3Credentials`` as JSON, which the worker signs that one fetch with; docs/security.md,
"Artifact credentials"). Each reference is named by its field (``env.KEY``,
``artifact.credentials``) in every refusal."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError
from sqlalchemy import delete, func, insert, or_, select, text, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.errors import Conflict, Forbidden, InvalidInput, NotFound
from libs.common.models import Artifact, Assignment, S3Credentials, SecretInfo, SecretRef
from services.core.db.tables import secrets
from services.core.db.teams import held_teams, teams_of
from services.core.identity.crypto import SecretBox, Unreadable

MASK = "***"
# Shorter values are not masked: masking "1" or "on" would hide every such letter pair.
MASK_MIN_LEN = 3

_INFO = (
    secrets.c.name,
    secrets.c.owner,
    secrets.c.team,
    secrets.c.created_at,
    secrets.c.updated_at,
    secrets.c.created_by,
    secrets.c.updated_by,
)


#: the field of a task that names its artifact's credentials
ARTIFACT_FIELD = "artifact.credentials"


def refers_to_secrets(env: str) -> str:
    """SQL: whether the task whose env column is ``env`` (``alias.env``) refers to secrets:
    an env value that is an object, or artifact credentials (the same alias's column)."""
    alias, _, _ = env.rpartition(".")
    credentials = f"{alias}.artifact_credentials" if alias else "artifact_credentials"
    return (
        f"(jsonb_path_exists({env}, '$.* ? (@.type() == \"object\")') OR {credentials} IS NOT NULL)"
    )


# The claimed tasks that refer to secrets, with their owners' recorded teams: a team's
# secret is given out only while the owner belongs to the team (checked at every lease).
_WITH_REFS = text(f"""
SELECT t.id, t.owner, t.env, t.artifact_credentials,
       ARRAY({held_teams("t.owner")}) AS teams
FROM core.tasks t
WHERE t.id = ANY(CAST(:ids AS bigint[])) AND {refers_to_secrets("t.env")}
""")

_OF_ATTEMPT = text(f"""
SELECT t.owner, t.env, t.artifact_credentials FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.id = :attempt AND {refers_to_secrets("t.env")}
""")


@dataclass(frozen=True)
class Scope:
    """Whose secret: an owner's, or (with ``team``) a team's."""

    owner: str | None
    team: str | None

    @classmethod
    def of(cls, owner: str, ref: SecretRef) -> Scope:
        return cls(None, ref.team) if ref.team else cls(owner, None)

    def context(self, name: str) -> bytes:
        """The associated data a value is sealed with: where it belongs."""
        kind, who = ("team", self.team) if self.team else ("owner", self.owner)
        return f"cairn-secret\x00{kind}\x00{who}\x00{name}".encode()

    def where(self) -> Any:
        if self.team:
            return secrets.c.team == self.team
        return (secrets.c.owner == self.owner) & secrets.c.team.is_(None)

    def describe(self) -> str:
        return f"team {self.team!r}" if self.team else f"{self.owner!r}"


def _info(row: Any) -> SecretInfo:
    return SecretInfo.model_validate(row._mapping)


async def create(
    conn: AsyncConnection, box: SecretBox, scope: Scope, name: str, value: str, by: str
) -> SecretInfo:
    kid, nonce, sealed = box.seal(value, scope.context(name))
    existing = await conn.execute(select(secrets.c.id).where(scope.where(), secrets.c.name == name))
    if existing.first() is not None:
        raise Conflict(f"name: {scope.describe()} has a secret {name!r} already; PUT replaces it")
    row = (
        await conn.execute(
            insert(secrets)
            .values(
                owner=scope.owner,
                team=scope.team,
                name=name,
                key_id=kid,
                nonce=nonce,
                ciphertext=sealed,
                created_by=by,
                updated_by=by,
            )
            .returning(*_INFO)
        )
    ).one()
    return _info(row)


async def replace(
    conn: AsyncConnection, box: SecretBox, scope: Scope, name: str, value: str, by: str
) -> SecretInfo:
    kid, nonce, sealed = box.seal(value, scope.context(name))
    row = (
        await conn.execute(
            update(secrets)
            .where(scope.where(), secrets.c.name == name)
            .values(
                key_id=kid, nonce=nonce, ciphertext=sealed, updated_by=by, updated_at=func.now()
            )
            .returning(*_INFO)
        )
    ).first()
    if row is None:
        raise NotFound(f"no secret {name!r} of {scope.describe()}")
    return _info(row)


async def remove(conn: AsyncConnection, scope: Scope, name: str) -> SecretInfo:
    row = (
        await conn.execute(
            delete(secrets).where(scope.where(), secrets.c.name == name).returning(*_INFO)
        )
    ).first()
    if row is None:
        raise NotFound(f"no secret {name!r} of {scope.describe()}")
    return _info(row)


async def remove_all(conn: AsyncConnection, scope: Scope) -> list[str]:
    """Delete every secret of ``scope`` (a team's, as the team goes); their names."""
    rows = await conn.execute(delete(secrets).where(scope.where()).returning(secrets.c.name))
    return sorted(row.name for row in rows)


async def list_(
    conn: AsyncConnection, owner: str | None, teams: frozenset[str] | None
) -> list[SecretInfo]:
    """The secrets of ``owner`` and of ``teams``; both None: every secret."""
    query = select(*_INFO).order_by(secrets.c.team.nulls_first(), secrets.c.owner, secrets.c.name)
    if owner is not None or teams is not None:
        query = query.where(or_(secrets.c.owner == owner, secrets.c.team.in_(sorted(teams or ()))))
    return [_info(row) for row in await conn.execute(query)]


# --- submissions: what a task may refer to ------------------------------------------------


class Asks(Protocol):
    """What of a submission (``TaskCreate``) or a stored task (``Task``) the rules read."""

    @property
    def team(self) -> str | None: ...
    @property
    def env(self) -> Mapping[str, Any]: ...
    @property
    def artifact(self) -> Artifact: ...


def refs_of(env: Mapping[str, Any]) -> dict[str, SecretRef]:
    """The env entries that are secret references (stored rows hold them as objects)."""
    return {key: _ref(value) for key, value in env.items() if not isinstance(value, str)}


def _ref(value: Any) -> SecretRef:
    """A reference as a submission, a stored row (a dict) or a stored task's answer (its
    stored form, ``Stored``) holds it."""
    if isinstance(value, SecretRef):
        return value
    return SecretRef.model_validate(value, from_attributes=not isinstance(value, dict))


def _named(env: Mapping[str, Any], credentials: Any) -> dict[str, SecretRef]:
    """Every secret reference of a task by its field: ``env.KEY``, ``artifact.credentials``."""
    named = {f"env.{key}": ref for key, ref in refs_of(env).items()}
    if credentials is not None:
        named[ARTIFACT_FIELD] = _ref(credentials)
    return named


def named_refs(spec: Asks) -> dict[str, SecretRef]:
    """The secret references of a submission or a stored task, by field."""
    return _named(spec.env, spec.artifact.credentials)


def teams_used(spec: Asks) -> frozenset[str]:
    """The teams whose secrets ``spec`` refers to."""
    return frozenset(ref.team for ref in named_refs(spec).values() if ref.team is not None)


def needs_check(spec: Asks) -> bool:
    return (
        spec.team is not None
        or spec.artifact.credentials is not None
        or any(not isinstance(v, str) for v in spec.env.values())
    )


def outside_teams(refs: Mapping[str, SecretRef], teams: frozenset[str]) -> tuple[str, str] | None:
    """The first (field, team) whose team secret ``refs`` name but ``teams`` (the
    teams the owner holds, teams.teams_of) do not hold: the one rule for who may use a team's
    secrets, at submit, retry and lease."""
    for key, ref in refs.items():
        if ref.team is not None and ref.team not in teams:
            return key, ref.team
    return None


async def check_submission(
    conn: AsyncConnection, owner: str, teams: frozenset[str], spec: Asks, field: str = ""
) -> None:
    """Refuse a submission (or a retry) whose ``team`` the owner does not belong to (403),
    or that refers to a secret the owner may not use or that does not exist (422),
    naming the field. A team's secrets need a membership the owner holds without a token
    (``teams.teams_of``: recorded, or vouched for by an identity provider's claim until its
    token expires): it is what every lease checks again."""
    if spec.team is not None and spec.team not in teams:
        raise Forbidden(f"{field}team: {owner!r} is not a member of team {spec.team!r}")
    refs = named_refs(spec)
    if teams_used(spec):
        outside = outside_teams(refs, teams & await teams_of(conn, owner))
        if outside is not None:
            key, team = outside
            raise Forbidden(
                f"{field}{key}: {owner!r} is not a member of team {team!r}, "
                "so may not use its secrets"
            )
    for key, ref in refs.items():
        scope = Scope.of(owner, ref)
        found = await conn.execute(
            select(secrets.c.id).where(scope.where(), secrets.c.name == ref.secret)
        )
        if found.first() is None:
            raise InvalidInput(f"{field}{key}: no secret {ref.secret!r} of {scope.describe()}")


# --- claims: the one place values are opened ----------------------------------------------


async def _open_all(
    conn: AsyncConnection, box: SecretBox, wanted: Iterable[tuple[Scope, str]]
) -> dict[tuple[Scope, str], str]:
    wanted = set(wanted)
    if not wanted:
        return {}
    owned = [(s.owner, n) for s, n in wanted if s.team is None]
    teamed = [(s.team, n) for s, n in wanted if s.team is not None]
    conditions: list[Any] = []
    if owned:
        conditions.append(
            tuple_(secrets.c.owner, secrets.c.name).in_(owned) & secrets.c.team.is_(None)
        )
    if teamed:
        conditions.append(tuple_(secrets.c.team, secrets.c.name).in_(teamed))
    rows = await conn.execute(select(secrets).where(or_(*conditions)))
    opened: dict[tuple[Scope, str], str] = {}
    for row in rows:
        scope = Scope(None, row.team) if row.team else Scope(row.owner, None)
        try:
            opened[(scope, row.name)] = box.open(
                row.key_id, row.nonce, row.ciphertext, scope.context(row.name)
            )
        except Unreadable:
            continue  # reported as missing: the attempt fails with a clear reason
    return opened


@dataclass(frozen=True)
class _Refs:
    """A leased task's secret references by field (``_named``), its owner and the teams it
    holds (teams.held_teams)."""

    owner: str
    refs: dict[str, SecretRef]
    teams: frozenset[str]

    def refusal(self) -> str | None:
        """Why the task's secrets are not given out: its owner left a team it names."""
        outside = outside_teams(self.refs, self.teams)
        if outside is None:
            return None
        key, team = outside
        return (
            f"{key}: {self.owner!r} is no longer a member of team {team!r}, "
            f"so its secret {self.refs[key].secret!r} is not given out"
        )

    def filled(
        self, assignment: Assignment, opened: Mapping[tuple[Scope, str], str]
    ) -> Assignment | str:
        """The assignment with its values, or why it cannot have them."""
        env = dict(assignment.env)
        credentials = None
        for key, ref in self.refs.items():
            scope = Scope.of(self.owner, ref)
            value = opened.get((scope, ref.secret))
            if value is None:
                return (
                    f"{key}: secret {ref.secret!r} of {scope.describe()} is gone or "
                    "cannot be opened with the configured keys"
                )
            if key != ARTIFACT_FIELD:
                env[key.removeprefix("env.")] = value
                continue
            credentials = s3_credentials(value)
            if credentials is None:
                return (
                    f"{key}: secret {ref.secret!r} of {scope.describe()} is not S3 "
                    "credentials (JSON with access_key_id and secret_access_key)"
                )
        return assignment.model_copy(update={"env": env, "artifact_credentials": credentials})


def s3_credentials(value: str) -> S3Credentials | None:
    """An artifact secret's value as credentials; None (and no word of the value) if it
    is not ``S3Credentials`` as JSON."""
    try:
        return S3Credentials.model_validate_json(value)
    except ValidationError:
        return None


async def fill(
    conn: AsyncConnection, box: SecretBox, leased: Sequence[Assignment]
) -> tuple[list[Assignment], dict[int, str]]:
    """The assignments with their secret env values filled in, and the attempts whose
    secrets are gone, unreadable, or a team's its owner no longer belongs to (attempt id
    -> reason); those are not handed out, and their secrets are not even opened."""
    if not leased:
        return [], {}
    rows = list(await conn.execute(_WITH_REFS, {"ids": [a.task_id for a in leased]}))
    if not rows:
        return list(leased), {}
    wanted = {
        row.id: _Refs(row.owner, _named(row.env, row.artifact_credentials), frozenset(row.teams))
        for row in rows
    }
    refused = {task_id: why for task_id, r in wanted.items() if (why := r.refusal()) is not None}
    opened = await _open_all(
        conn,
        box,
        (
            (Scope.of(r.owner, ref), ref.secret)
            for task_id, r in wanted.items()
            if task_id not in refused
            for ref in r.refs.values()
        ),
    )
    ready: list[Assignment] = []
    broken: dict[int, str] = {}
    for assignment in leased:
        found = wanted.get(assignment.task_id)
        if found is None:
            ready.append(assignment)
            continue
        done = refused.get(assignment.task_id) or found.filled(assignment, opened)
        if isinstance(done, str):
            broken[assignment.attempt_id] = done
        else:
            ready.append(done)
    return ready, broken


def _maskable(opened: Iterable[str]) -> Iterable[str]:
    """The values to hide: each secret's, and the parts of those that are credentials (an
    error may quote a key without the JSON around it)."""
    for value in opened:
        yield value
        credentials = s3_credentials(value) if value.startswith("{") else None
        if credentials is not None:
            yield from (credentials.access_key_id, credentials.secret_access_key)
            if credentials.session_token:
                yield credentials.session_token


def mask_json(mask: Callable[[str], str], value: Any) -> Any:
    """``value`` (decoded JSON, such as an attempt's outputs) with ``mask`` applied to
    every string in it, keys included."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, list):
        return [mask_json(mask, item) for item in value]
    if isinstance(value, dict):
        return {mask(key): mask_json(mask, item) for key, item in value.items()}
    return value


async def masker(
    conn: AsyncConnection, box: SecretBox, attempt_id: int
) -> Callable[[str], str] | None:
    """What hides the attempt's secret values in text its worker sends (None: it has none)."""
    row = (await conn.execute(_OF_ATTEMPT, {"attempt": attempt_id})).first()
    if row is None:
        return None
    refs = _named(row.env, row.artifact_credentials)
    opened = await _open_all(conn, box, ((Scope.of(row.owner, r), r.secret) for r in refs.values()))
    values = sorted(
        (v for v in _maskable(opened.values()) if len(v) >= MASK_MIN_LEN), key=len, reverse=True
    )
    if not values:
        return None

    def mask(content: str) -> str:
        for value in values:
            content = content.replace(value, MASK)
        return content

    return mask
