"""People and their rights from the command line: ``token``, ``team``, ``secret`` and
``audit``, over core's API. ``token create --db`` (or ``--from-env``) writes straight
to the database instead: how the first admin token and a deployment's own service
tokens come to be."""

from __future__ import annotations

import os
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer

from cairn import output, system
from cairn.tasks_cli import JsonFlag, ctx_of
from libs.common.errors import CairnError
from libs.common.models import KeyStatus, RekeyResult, SealedCount, TokenCreate, TokenInfo

token_app = typer.Typer(help="Bearer tokens: create, list, revoke.", no_args_is_help=True)
team_app = typer.Typer(help="Teams and their members (admins manage them).", no_args_is_help=True)
secret_app = typer.Typer(help="Secrets tasks refer to by name.", no_args_is_help=True)
audit_app = typer.Typer(help="The audit trail: read, export, verify.")

_SPAN = re.compile(r"^(\d+)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def expiry(text: str | None) -> datetime | None:
    """``30d``, ``12h``, ``90m``, ``45s`` from now, or an ISO 8601 time with its offset."""
    if text is None:
        return None
    span = _SPAN.match(text)
    if span:
        return datetime.now(UTC) + timedelta(seconds=int(span[1]) * _UNIT[span[2]])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        output.errors.print(
            f"cairn: --expires {output.safe(repr(text))}: give 30d, 12h, 90m or an ISO time"
        )
        raise typer.Exit(2) from None
    if when.tzinfo is None:
        output.errors.print("cairn: --expires needs a UTC offset (e.g. 2027-01-01T00:00:00Z)")
        raise typer.Exit(2)
    return when


def _token_rows(items: list[TokenInfo]) -> list[list[Any]]:
    return [
        [
            t.id,
            t.name,
            t.principal,
            t.role,
            output.when(t.expires_at) or "never",
            output.ago(t.last_used_at) or "never",
            "revoked " + output.when(t.revoked_at) if t.revoked_at else "live",
        ]
        for t in items
    ]


def _create_in_database(
    ctx: typer.Context, principal: str, role: str, label: str, from_env: str | None
) -> str:
    from services.core import admin

    given = None
    if from_env:
        given = os.environ.get(from_env)
        if not given:
            output.errors.print(f"cairn: {from_env} is not set")
            raise typer.Exit(2)
    settings = ctx_of(ctx).settings
    system.prepare_home(settings)
    url, started = system.database(settings)
    direct = settings.direct_url(url)
    try:
        system.migrate_or_exit(direct)
        return admin.create_token(direct, principal, role, given, label)
    except CairnError as exc:
        output.errors.print(f"cairn: {output.safe(exc.detail)}")
        raise typer.Exit(2) from None
    finally:
        if started is not None:
            started.stop()


@token_app.command("create")
def token_create(
    ctx: typer.Context,
    principal: Annotated[
        str | None, typer.Argument(help="whose token (default: your own; others: admins)")
    ] = None,
    role: Annotated[
        str | None, typer.Option(help=f"{', '.join(system.ROLES)}, for a new principal")
    ] = None,
    name: Annotated[str, typer.Option("--name", help="what the token is for")] = "cli",
    expires: Annotated[
        str | None, typer.Option(help="30d, 12h, 90m, or an ISO time (default: never)")
    ] = None,
    db: Annotated[
        bool, typer.Option("--db", help="write to the database directly (the first admin)")
    ] = False,
    from_env: Annotated[
        str | None,
        typer.Option(
            "--from-env",
            metavar="VAR",
            help="register the token held in environment variable VAR instead of making one "
            "(implies --db; idempotent; for deployments that keep their service tokens as "
            "secrets)",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a token and print it (it is shown this once)."""
    if role is not None and role not in system.ROLES:
        output.errors.print(f"cairn: --role must be one of {', '.join(system.ROLES)}")
        raise typer.Exit(2)
    if db or from_env:
        if principal is None:
            output.errors.print("cairn: --db needs the principal's name")
            raise typer.Exit(2)
        sys.stdout.write(_create_in_database(ctx, principal, role or "user", name, from_env) + "\n")
        return
    c = ctx_of(ctx)
    body = TokenCreate(name=name, principal=principal, role=role, expires_at=expiry(expires))

    async def go() -> Any:
        async with c.core() as core:
            return await core.create_token(body)

    made = output.call(go)
    if c.json or as_json:
        output.dump(made)
    else:
        sys.stdout.write(made.token + "\n")


@token_app.command("ls")
def token_ls(
    ctx: typer.Context,
    principal: Annotated[str | None, typer.Option(help="one principal's (admins)")] = None,
    revoked: Annotated[bool, typer.Option("--revoked", help="include revoked ones")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Tokens (never their values): yours, or for an admin everyone's."""
    c = ctx_of(ctx)

    async def go() -> list[TokenInfo]:
        async with c.core() as core:
            return await core.tokens(principal, revoked)

    items = output.call(go)
    if c.json or as_json:
        output.dump(items)
        return
    columns = ["id", "name", "principal", "role", "expires", "last used", "state"]
    output.table(None, columns, _token_rows(items))


@token_app.command("revoke")
def token_revoke(ctx: typer.Context, token_id: int) -> None:
    """Revoke a token by id (see `cairn token ls`)."""
    c = ctx_of(ctx)

    async def go() -> None:
        async with c.core() as core:
            await core.revoke_token(token_id)

    output.call(go)
    output.console.print(f"token {token_id} revoked")


def _team_command(ctx: typer.Context, as_json: bool, call: Any) -> None:
    c = ctx_of(ctx)

    async def go() -> Any:
        async with c.core() as core:
            return await call(core)

    found = output.call(go)
    if found is None:
        return
    items = found if isinstance(found, list) else [found]
    if c.json or as_json:
        output.dump(found)
        return
    output.table(
        None,
        ["team", "members", "created"],
        [[t.name, ", ".join(t.members), output.when(t.created_at)] for t in items],
    )


@team_app.command("create")
def team_create(
    ctx: typer.Context,
    name: str,
    reuse_name: Annotated[
        bool,
        typer.Option(
            "--reuse-name",
            help="Take a deleted team's name: its tasks, schedules and workflows still name "
            "it, and the new team's members will see and act on them.",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Create a team (admins)."""
    _team_command(ctx, as_json, lambda core: core.create_team(name, reuse_name))


@team_app.command("ls")
def team_ls(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Teams: every one for admins, your own for everyone else."""
    _team_command(ctx, as_json, lambda core: core.teams())


@team_app.command("add")
def team_add(ctx: typer.Context, team: str, member: str, as_json: JsonFlag = False) -> None:
    """Add a member to a team (admins)."""
    _team_command(ctx, as_json, lambda core: core.add_member(team, member))


@team_app.command("rm")
def team_rm(ctx: typer.Context, team: str, member: str, as_json: JsonFlag = False) -> None:
    """Remove a member from a team (admins)."""
    _team_command(ctx, as_json, lambda core: core.remove_member(team, member))


@team_app.command("delete")
def team_delete(ctx: typer.Context, team: str) -> None:
    """Delete a team (admins); work it owned stays with its submitters."""
    _team_command(ctx, False, lambda core: core.delete_team(team))


@secret_app.command("set")
def secret_set(
    ctx: typer.Context,
    name: str,
    team: Annotated[str | None, typer.Option(help="a team's secret")] = None,
    from_env: Annotated[
        str | None, typer.Option("--from-env", metavar="VAR", help="read the value from VAR")
    ] = None,
) -> None:
    """Create or replace a secret. The value comes from --from-env or standard input,
    never from an argument (which shell history and `ps` would show)."""
    value = os.environ.get(from_env, "") if from_env else sys.stdin.read().rstrip("\n")
    if not value:
        output.errors.print("cairn: the secret's value is empty")
        raise typer.Exit(2)
    c = ctx_of(ctx)

    async def go() -> Any:
        async with c.core() as core:
            return await core.put_secret(name, value, team)

    info = output.call(go)
    team_note = f" for team {output.safe(team)}" if team else ""
    output.console.print(f"secret {output.safe(info.name)} stored{team_note}")


@secret_app.command("ls")
def secret_ls(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Your secrets and your teams' (names and times only)."""
    c = ctx_of(ctx)

    async def go() -> Any:
        async with c.core() as core:
            return await core.secrets()

    items = output.call(go)
    if c.json or as_json:
        output.dump(items)
        return
    rows = [
        [s.name, s.team or "", s.owner or "", output.when(s.updated_at), s.updated_by]
        for s in items
    ]
    output.table(None, ["name", "team", "owner", "updated", "by"], rows)


@secret_app.command("rm")
def secret_rm(
    ctx: typer.Context,
    name: str,
    team: Annotated[str | None, typer.Option(help="a team's secret")] = None,
) -> None:
    """Delete a secret."""
    c = ctx_of(ctx)

    async def go() -> None:
        async with c.core() as core:
            await core.delete_secret(name, team)

    output.call(go)
    output.console.print(f"secret {output.safe(name)} deleted")


@secret_app.command("keys")
def secret_keys(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Which secrets keys core holds, and how many values each seals (admins)."""
    c = ctx_of(ctx)

    async def go() -> KeyStatus:
        async with c.core() as core:
            return await core.key_status()

    found = output.call(go)
    if c.json or as_json:
        output.dump(found)
        return
    output.table(
        None,
        ["sealed", "key", "values", "key is"],
        [[k.column, k.key_id, k.rows, _key_role(k)] for k in found.columns],
    )
    output.console.print(f"{found.remaining} values under a key other than {found.current}")


def _key_role(count: SealedCount) -> str:
    if count.current:
        return "current"
    return "older: run cairn secret rekey" if count.configured else "not configured: unreadable"


@secret_app.command("rekey")
def secret_rekey(
    ctx: typer.Context,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="values per call")] = 1000,
    as_json: JsonFlag = False,
) -> None:
    """Seal every secret anew under core's current key (the first of CAIRN_SECRETS_KEY),
    so that older keys can be removed (admins). Safe while core serves; run it again at
    will. Exit 1 if values remain under another key."""
    c = ctx_of(ctx)

    async def go() -> RekeyResult:
        total = unreadable = 0
        after: str | None = None
        async with c.core() as core:
            while True:
                done = await core.rekey(batch, after)
                total += done.rekeyed
                unreadable += done.unreadable
                if done.next is None:
                    return done.model_copy(update={"rekeyed": total, "unreadable": unreadable})
                after = done.next

    result = output.call(go)
    if c.json or as_json:
        output.dump(result)
    else:
        output.console.print(
            f"{result.rekeyed} values sealed anew under key {result.key_id}; "
            f"{result.remaining} remain under another key"
        )
    if result.remaining:
        output.errors.print(
            "cairn: values remain under another key: ones no configured key opens, or ones "
            "being changed at that moment (see cairn secret keys; run it again)"
        )
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(token_app, name="token")
    app.add_typer(team_app, name="team")
    app.add_typer(secret_app, name="secret")
    app.add_typer(audit_app, name="audit")


@audit_app.callback(invoke_without_command=True)
def audit(
    ctx: typer.Context,
    actor: Annotated[str | None, typer.Option(help="who acted")] = None,
    action: Annotated[str | None, typer.Option(help="token, token.revoke, queue...")] = None,
    target: Annotated[str | None, typer.Option(help="e.g. queue:default, task:42")] = None,
    since: Annotated[str | None, typer.Option(help="30d, 12h, or an ISO time")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    as_json: JsonFlag = False,
) -> None:
    """The audit trail (admins): who did what, when, from where; export and verify it."""
    if ctx.invoked_subcommand is not None:
        return
    c = ctx_of(ctx)
    after = None
    if since is not None:
        span = _SPAN.match(since)
        after = (
            datetime.now(UTC) - timedelta(seconds=int(span[1]) * _UNIT[span[2]])
            if span
            else expiry(since)
        )

    async def go() -> Any:
        async with c.core() as core:
            return await core.audit(
                actor=actor,
                action=action,
                target=target,
                since=after.isoformat() if after else None,
                limit=limit,
            )

    page = output.call(go)
    if c.json or as_json:
        output.dump(page)
        return
    rows = [
        [
            e.id,
            output.when(e.at),
            e.actor,
            e.action,
            e.target,
            e.source or "",
            e.after or e.before or "",
        ]
        for e in page.items
    ]
    output.table(None, ["id", "at", "actor", "action", "target", "from", "detail"], rows)


@audit_app.command("export")
def audit_export(
    ctx: typer.Context,
    to: Annotated[
        str, typer.Option("--to", help="a file (appended), - for stdout, or s3://bucket/prefix")
    ] = "-",
    since: Annotated[
        int, typer.Option("--since", min=0, help="export the rows after this id (0: all)")
    ] = 0,
    s3_endpoint_url: Annotated[
        str | None, typer.Option(help="an S3-compatible store's URL (MinIO, Ceph)")
    ] = None,
) -> None:
    """Write the chained trail as JSON lines, oldest first (admins). Go on from where
    the last one stopped with --since: the last id written is printed on stderr."""
    from services.core.domain import auditchain
    from services.core.ops import auditexport

    c = ctx_of(ctx)
    sink = auditexport.sink_for(to, s3_endpoint_url)

    async def go() -> tuple[int, int]:
        after, count = since, 0
        async with c.core() as core:
            while True:
                page = await core.audit_chain(after)
                if page.items:
                    rows = [item.model_dump() for item in page.items]
                    data = b"".join(auditchain.line(row) for row in rows)
                    await sink.write(page.items[0].id, page.items[-1].id, data)
                    after, count = page.items[-1].id, count + len(page.items)
                if page.next_after is None:
                    return count, after

    count, last = output.call(go)
    output.errors.print(f"cairn: {count} audit rows exported; the last id is {last}")


@audit_app.command("verify")
def audit_verify(
    path: Annotated[str, typer.Argument(help="an export's JSON lines (- for stdin)")],
    from_start: Annotated[
        bool, typer.Option("--from-start", help="the file begins with the trail's first row")
    ] = False,
) -> None:
    """Recompute an export's hash chain; report the first gap or edit (exit 1)."""
    from services.core.domain import auditchain

    anchor = auditchain.GENESIS if from_start else None
    try:
        if path == "-":
            verdict = auditchain.verify(sys.stdin.buffer, anchor)
        else:
            with open(path, "rb") as f:
                verdict = auditchain.verify(f, anchor)
    except OSError as exc:
        output.errors.print(f"cairn: {output.safe(path)}: {exc.strerror}")
        raise typer.Exit(2) from None
    if verdict.ok:
        span = f" (ids {verdict.first_id} to {verdict.last_id})" if verdict.rows else ""
        output.console.print(f"{verdict.rows} audit rows, chain intact{span}")
        return
    output.errors.print(
        f"cairn: chain broken at line {verdict.at_line}: {output.safe(verdict.problem or '')}"
        f" ({verdict.rows} rows before it hold)"
    )
    raise typer.Exit(1)
