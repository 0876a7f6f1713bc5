"""Placement from the command line: why a task waits, right-sizing, and the trace-driven
simulator (``cairn trace``, ``cairn sim``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from cairn import output
from cairn.tasks_cli import JsonFlag, _get, ctx_of
from libs.common.models import Task
from libs.common.settings import parse_devices, parse_labels
from libs.common.states import FINAL, TaskState


def reason_of(task: Task) -> str:
    """Why the task is where it is: the pending reason core gives a task that waits, or
    what ended it, or which attempt runs it."""
    if task.pending_reason:
        return task.pending_reason
    if task.state is TaskState.RUNNING:
        return f"attempt {task.current_attempt_id} of it is running"
    if task.state in FINAL:
        when = f" at {task.finished_at:%Y-%m-%d %H:%M:%S %Z}" if task.finished_at else ""
        ended = f"it ended{when} after {task.attempts} attempt(s); nothing holds it"
        if task.state is TaskState.CANCELLED:
            ended = f"it was cancelled{when}; nothing holds it"
        if task.state is TaskState.DEAD and task.last_error:
            ended += f" (the last error: {task.last_error})"
        return ended
    return "core gave no reason"


def _override(
    cluster: dict[str, Any], workers: int | None, labels: list[str], devices: list[dict[str, int]]
) -> None:
    """The trace's cluster as the flags change it."""
    if workers:
        cluster["workers"] = workers
    if labels:
        cluster["labels"] = [parse_labels(item) for item in labels]
    if devices:
        cluster["devices"] = devices


def _devices_of(flags: list[str]) -> list[dict[str, int]]:
    try:
        return [parse_devices(item) for item in flags]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--worker-devices") from None


def register(app: typer.Typer) -> None:
    @app.command()
    def why(ctx: typer.Context, task_id: int, as_json: JsonFlag = False) -> None:
        """Say why a task is not running (or that it has ended, and how)."""
        c = ctx_of(ctx)
        task = output.call(lambda: _get(c, task_id))
        reason = reason_of(task)
        if c.json or as_json:
            output.dump({"id": task.id, "state": task.state, "reason": reason})
        else:
            output.console.print(
                f"task {task.id} ({output.safe(task.name)}) is {output.state(task.state)}: "
                f"{output.safe(reason)}"
            )

    @app.command()
    def rightsize(
        ctx: typer.Context,
        owner: Annotated[str | None, typer.Option()] = None,
        name: Annotated[str | None, typer.Option(help="task name")] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Requested against measured use, per owner and task name, with a suggestion."""
        c = ctx_of(ctx)

        async def go() -> Any:
            async with c.core() as core:
                return await core.usage(owner, name)

        rows = output.call(go)
        if c.json or as_json:
            output.dump(rows)
            return
        output.table(
            None,
            ["owner", "name", "runs", "cpu req/p95/suggest", "memory MB req/p95/suggest", "used"],
            [
                [
                    r.owner,
                    r.name,
                    r.attempts,
                    f"{r.requested_cpu:g}/{r.p95_cpu:.2f}/{r.suggested_cpu:g}",
                    f"{r.requested_memory_mb:.0f}/{r.p95_memory_mb:.0f}/{r.suggested_memory_mb}",
                    f"{r.used_share:.0%}",
                ]
                for r in rows
            ],
        )

    @app.command()
    def trace(
        out: Path,
        users: Annotated[int, typer.Option()] = 10_000,
        tasks_per_user: Annotated[float, typer.Option()] = 100.0,
        hours: Annotated[float, typer.Option()] = 24.0,
        seed: Annotated[int, typer.Option()] = 7,
        flood: Annotated[int, typer.Option(help="one owner submits this many at once")] = 0,
        flood_at: Annotated[float, typer.Option(help="seconds in")] = 600.0,
    ) -> None:
        """Write a workload trace from the design's figures."""
        from cairn.trace import Shape, write

        shape = Shape(
            users=users,
            tasks_per_user=tasks_per_user,
            hours=hours,
            seed=seed,
            flood_tasks=flood,
            flood_at_s=flood_at,
        )
        count = write(out, shape)
        output.console.print(f"{count} submissions written to {out}")

    @app.command()
    def sim(
        trace: Path,
        declared: Annotated[bool, typer.Option(help="place everything on requests")] = False,
        overcommit: Annotated[float, typer.Option()] = 1.0,
        defer_above: Annotated[float, typer.Option()] = 1.0,
        workers: Annotated[int | None, typer.Option(help="override the trace's cluster")] = None,
        fair: Annotated[bool, typer.Option(help="fair share across owners")] = True,
        worker_labels: Annotated[
            list[str] | None,
            typer.Option(help="KEY=VALUE,...: the labels of every Nth worker, dealt in turn"),
        ] = None,
        worker_devices: Annotated[
            list[str] | None,
            typer.Option(help="NAME=COUNT,...: the devices of every Nth worker, dealt in turn"),
        ] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Replay a trace through core's placement on a simulated clock."""
        from cairn.sim import Policy, render, simulate
        from cairn.trace import read

        devices = _devices_of(worker_devices or [])
        meta, submissions = read(trace)
        _override(meta["cluster"], workers, worker_labels or [], devices)
        policy = Policy(
            measured=not declared, overcommit=overcommit, defer_above=defer_above, fair=fair
        )
        figures = simulate(meta, submissions, policy)
        if as_json:
            output.dump(figures)
            return
        output.console.out(render(meta, policy, figures), highlight=False)


def _device_hours(held: dict[str, float]) -> str:
    return ", ".join(f"{name} {s / 3600:.2f}" for name, s in sorted(held.items()))


def register_usage(app: typer.Typer) -> None:
    """``cairn usage``: the month's accounting."""

    @app.command()
    def usage(
        ctx: typer.Context,
        month: Annotated[str | None, typer.Option(help="as 2026-12; this month")] = None,
        by: Annotated[str, typer.Option(help="owner, team or queue")] = "owner",
        as_json: JsonFlag = False,
    ) -> None:
        """What a month's attempts used, by owner, team or queue (your own and your
        teams' unless you are an admin): CPU used, core-hours and GB-hours reserved,
        device-hours held (``gpu 2.00``)."""
        c = ctx_of(ctx)

        async def go() -> Any:
            async with c.core() as core:
                return await core.usage_accounts(month, by)

        found = output.call(go)
        if c.json or as_json:
            output.dump(found)
            return
        output.table(
            f"usage in {found.month}, by {found.by}",
            [by, "attempts", "wall h", "cpu h used", "core-h reserved", "GB-h reserved",
             "peak MB", "device h"],
            [
                [
                    output.safe(a.key),
                    a.attempts,
                    f"{a.wall_s / 3600:.2f}",
                    f"{a.cpu_s / 3600:.2f}",
                    f"{a.cpu_reserved_s / 3600:.2f}",
                    f"{a.memory_mb_s / 1024 / 3600:.2f}",
                    f"{a.peak_memory_mb:.0f}",
                    output.safe(_device_hours(a.device_s)),
                ]
                for a in found.items
            ],
        )  # fmt: skip
