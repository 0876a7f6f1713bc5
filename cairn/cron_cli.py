"""``cairn cron ...``: schedules in the cron service."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cairn import output
from cairn.tasks_cli import JsonFlag, ctx_of, load_document, sha256_of, validated
from libs.common.cron_client import CronClient
from libs.common.cron_models import Schedule, ScheduleCreate

app = typer.Typer(
    help="Cron schedules: add, ls, next, pause, resume, trigger, backfill, fires, rm."
)


def _client(ctx: typer.Context) -> CronClient:
    c = ctx_of(ctx)
    return CronClient(c.settings.cron_url, c.settings.bearer())


def _rows(items: list[Schedule]) -> list[list[Any]]:
    return [
        [
            s.id,
            s.name,
            s.expression,
            s.timezone,
            s.target.kind,
            "paused" if s.paused else output.when(s.next_fire_at),
            s.owner,
        ]
        for s in items
    ]


COLUMNS = ["id", "name", "expression", "zone", "target", "next fire", "owner"]


@app.command("add")
def add(
    ctx: typer.Context,
    name: str,
    expression: Annotated[str, typer.Argument(help="5 fields or a macro such as @daily")],
    tz: Annotated[str, typer.Option("--tz", help="IANA time zone")] = "UTC",
    artifact: Annotated[str | None, typer.Option(help="task target: executable URI")] = None,
    sha256: Annotated[str | None, typer.Option(help="its digest (read for file://)")] = None,
    arg: Annotated[list[str] | None, typer.Option("--arg", "-a")] = None,
    queue: Annotated[str, typer.Option()] = "default",
    task_file: Annotated[
        Path | None, typer.Option(help="task target: a submission as JSON or YAML")
    ] = None,
    workflow: Annotated[str | None, typer.Option(help="workflow target: its name")] = None,
    param: Annotated[list[str] | None, typer.Option(help="workflow parameter KEY=VALUE")] = None,
    misfire: Annotated[str, typer.Option(help="skip, fire_once or catch_up")] = "fire_once",
    catch_up_limit: Annotated[int, typer.Option()] = 10,
    overlap: Annotated[str, typer.Option(help="allow, forbid or replace")] = "allow",
    jitter: Annotated[
        int, typer.Option(help="start each fire's task 0..N s after its slot (fixed per schedule)")
    ] = 0,
    paused: Annotated[bool, typer.Option()] = False,
    team: Annotated[
        str | None, typer.Option(help="a team of yours: its members see and act on it")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Register a schedule that submits a task or starts a workflow run."""
    target: dict[str, Any]
    if workflow:
        target = {"kind": "dag", "workflow": workflow, "params": output.pairs(param or [])}
    else:
        task: dict[str, Any] = dict(load_document(task_file)) if task_file else {}
        task.setdefault("name", name)
        if artifact:
            task["artifact"] = {"uri": artifact, "sha256": sha256 or sha256_of(artifact)}
        if arg:
            task["args"] = list(arg)
        if queue != "default":
            task["queue"] = queue
        target = {"kind": "task", "task": task}
    body = validated(
        ScheduleCreate,
        {
            "name": name,
            "expression": expression,
            "timezone": tz,
            "target": target,
            "misfire_policy": misfire,
            "catch_up_limit": catch_up_limit,
            "overlap_policy": overlap,
            "jitter_s": jitter,
            "paused": paused,
            **({"team": team} if team else {}),
        },
        "the schedule",
    )

    async def go() -> Schedule:
        async with _client(ctx) as cron:
            return await cron.create(body)

    made = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(made)
    else:
        output.console.print(
            f"schedule [bold]{made.id}[/bold] {output.safe(made.name)}: next fire "
            f"{output.when(made.next_fire_at)}"
        )


@app.command("ls")
def list_schedules(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Your schedules (every owner's for admins)."""

    async def go() -> list[Schedule]:
        found: list[Schedule] = []
        after = 0
        async with _client(ctx) as cron:
            while True:
                page = await cron.list_page(after=after, limit=1000)
                found.extend(page.items)
                if page.next_after is None:
                    return found
                after = page.next_after

    items = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(items)
    else:
        output.table(None, COLUMNS, _rows(items))


@app.command("next")
def next_fires(
    ctx: typer.Context,
    schedule_id: int,
    n: Annotated[int, typer.Option("-n", min=1, max=1000)] = 10,
    after: Annotated[
        datetime | None, typer.Option(help="preview from this instant (ISO 8601)")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """The next fires, in UTC and on the schedule's wall clock."""

    async def go() -> Any:
        async with _client(ctx) as cron:
            return await cron.next(schedule_id, n, after)

    found = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(found)
    else:
        output.table(
            f"schedule {schedule_id} ({found.timezone})",
            ["UTC", "local"],
            [[output.when(i.utc), i.local] for i in found.items],
        )


def _one(name: str, doc: str, method: str) -> None:
    def command(ctx: typer.Context, schedule_id: int, as_json: JsonFlag = False) -> None:
        async def go() -> Any:
            async with _client(ctx) as cron:
                return await getattr(cron, method)(schedule_id)

        done = output.call(go)
        if ctx_of(ctx).json or as_json:
            output.dump(done)
        elif isinstance(done, Schedule):
            output.table(None, COLUMNS, _rows([done]))
        elif done is not None:
            output.console.print(
                f"fired: {output.state(done.outcome)} task {done.task_id or ''}"
                f"{' run ' + str(done.run_id) if done.run_id else ''}"
            )
        else:
            output.console.print(f"schedule {schedule_id} deleted")

    command.__doc__ = doc
    app.command(name)(command)


@app.command("backfill")
def backfill(
    ctx: typer.Context,
    schedule_id: int,
    start: Annotated[
        datetime, typer.Option("--from", help="first instant (ISO 8601, UTC if no offset)")
    ],
    end: Annotated[datetime, typer.Option("--to", help="last instant (ISO 8601), up to now")],
    as_json: JsonFlag = False,
) -> None:
    """Fire every slot from --from to --to once (slots fired before are left alone)."""

    def aware(at: datetime) -> datetime:
        return at if at.tzinfo else at.replace(tzinfo=UTC)

    async def go() -> Any:
        async with _client(ctx) as cron:
            return await cron.backfill(schedule_id, aware(start), aware(end))

    done = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(done)
    else:
        span = f" ({output.when(done.first)} .. {output.when(done.last)})" if done.slots else ""
        output.console.print(
            f"schedule {schedule_id}: {done.slots} slots{span}, {done.queued} queued to fire, "
            f"{done.already} fired before"
        )


_one("get", "Show one schedule.", "get")
_one("pause", "Pause a schedule.", "pause")
_one("resume", "Resume a schedule (slots that passed while paused do not fire).", "resume")
_one("trigger", "Fire a schedule now, once.", "trigger")
_one("rm", "Delete a schedule and its fire history.", "delete")


@app.command("fires")
def fires(
    ctx: typer.Context,
    schedule_id: int,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
    as_json: JsonFlag = False,
) -> None:
    """A schedule's fire history, newest first."""

    async def go() -> Any:
        async with _client(ctx) as cron:
            return await cron.fires(schedule_id, limit)

    found = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(found)
    else:
        output.table(
            None,
            ["slot", "outcome", "task", "run", "lag ms", "tries", "detail"],
            [
                [
                    output.when(f.fire_time)
                    + (" (manual)" if f.manual else "")
                    + (" (backfill)" if f.backfill else ""),
                    output.state(f.outcome),
                    f.task_id,
                    f.run_id,
                    f"{f.lag_ms:.0f}" if f.lag_ms is not None else "",
                    f.tries,
                    f.detail or "",
                ]
                for f in found
            ],
        )
