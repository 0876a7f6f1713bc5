"""Sharing from the command line: ``cairn quota`` (an owner's or a team's share, use and
quotas)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cairn import output
from cairn.tasks_cli import JsonFlag, ctx_of

_QUOTA_COLUMNS = [
    "owner", "weight", "share", "running", "cpu", "memory MB", "devices", "waiting", "at quota",
    "core-h used (decayed)",
]  # fmt: skip


def _limit(used: float, most: float | None) -> str:
    return f"{used:g}/{most:g}" if most is not None else f"{used:g}"


def _devices(used: dict[str, int], most: dict[str, int]) -> str:
    names = sorted({*used, *most})
    return ", ".join(f"{n} {_limit(used.get(n, 0), most.get(n))}" for n in names) or "-"


def _quota_row(r: Any) -> list[Any]:
    q = r.quota
    return [
        f"{r.name} (team)" if r.kind == "team" else r.name,
        f"{r.weight:g}",
        f"{r.share:.1%}",
        _limit(r.running.attempts, q.max_running),
        _limit(r.running.cpu, q.max_cpu),
        _limit(r.running.memory_mb, q.max_memory_mb),
        _devices(r.running.devices, q.max_devices or {}),
        _limit(r.waiting, q.max_waiting),
        ", ".join(r.at_quota) or "-",
        f"{r.decayed_cpu_s / 3600:.2f}",
    ]


def register(app: typer.Typer) -> None:
    @app.command()
    def quota(
        ctx: typer.Context,
        name: Annotated[str | None, typer.Argument(help="owner (default: you)")] = None,
        team: Annotated[str | None, typer.Option(help="a team's instead (members, admins)")] = None,
        top: Annotated[int, typer.Option(help="list the owners with most work")] = 0,
        weight: Annotated[float | None, typer.Option(help="set (admin)")] = None,
        cpu: Annotated[float | None, typer.Option(help="set max running CPU (admin)")] = None,
        memory_mb: Annotated[float | None, typer.Option(help="set max running MB")] = None,
        running: Annotated[int | None, typer.Option(help="set max running attempts")] = None,
        waiting: Annotated[int | None, typer.Option(help="set max waiting tasks")] = None,
        per_minute: Annotated[int | None, typer.Option(help="set max submits a minute")] = None,
        devices: Annotated[
            str | None, typer.Option(help="set max running devices: gpu=2,fpga=1")
        ] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """An owner's (or with --team, a team's) share, use and quotas; with options, set
        them (admin). A team's quotas bound the sum over the tasks it owns."""
        from libs.common.models import ShareSettings
        from libs.common.settings import parse_devices

        c = ctx_of(ctx)
        try:
            max_devices = parse_devices(devices) if devices is not None else None
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--devices") from None
        given = {
            "weight": weight,
            "max_cpu": cpu,
            "max_memory_mb": memory_mb,
            "max_running": running,
            "max_waiting": waiting,
            "max_submits_per_min": per_minute,
            "max_devices": max_devices,
        }
        change = ShareSettings(**{k: v for k, v in given.items() if v is not None})

        async def go() -> Any:
            async with c.core() as core:
                if top:
                    return await core.top_owners(top)
                if team is not None:
                    if change.model_fields_set:
                        return [await core.set_team_share(team, change)]
                    return [await core.team_usage(team)]
                who = name or (await core.whoami()).name
                if change.model_fields_set:
                    return [await core.set_share(who, change)]
                return [await core.owner_usage(who)]

        rows = output.call(go)
        if c.json or as_json:
            output.dump(rows)
            return
        output.table(None, _QUOTA_COLUMNS, [_quota_row(r) for r in rows])
