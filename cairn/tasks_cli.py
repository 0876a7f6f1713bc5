"""Single tasks from the command line: submit, get, ls, cancel, retry, logs, wait, and the
workers and queues that run them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from pydantic import ValidationError
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cairn import output
from cairn.config import ClientSettings
from libs.common.client import CoreClient
from libs.common.egress import parse_destination
from libs.common.errors import CairnError
from libs.common.models import (
    NO_RETRY_EXIT_CODE,
    BulkAction,
    BulkResult,
    Egress,
    LogEnd,
    Placement,
    QueueSettings,
    RetryCauses,
    Task,
    TaskCreate,
    TaskProgress,
)
from libs.common.settings import parse_devices
from libs.common.states import FINAL, TaskState

JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


@dataclass
class Ctx:
    settings: ClientSettings
    json: bool

    def core(self) -> CoreClient:
        return CoreClient(self.settings.url, self.settings.bearer())


def ctx_of(ctx: typer.Context) -> Ctx:
    found: Ctx = ctx.obj
    return found


def _utc(value: str | None) -> str | None:
    """An ISO time as given; one without an offset is taken as UTC."""
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        output.errors.print(
            f"[red]error[/red] {output.safe(repr(value))} is not an ISO time (2026-11-30T22:00)"
        )
        raise typer.Exit(2) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).isoformat()


def _each_task(c: Ctx, method: str, task_ids: list[int], as_json: bool) -> None:
    async def go() -> list[Task]:
        async with c.core() as core:
            return [await getattr(core, method)(t) for t in task_ids]

    done = output.call(go)
    if c.json or as_json:
        output.dump(done)
    else:
        for task in done:
            output.console.print(f"task {task.id} {output.state(task.state)}")


def _by_filter(
    c: Ctx,
    method: str,
    selector: dict[str, Any],
    limit: int,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Count first, ask (unless --yes), then act; a bad filter is named by the server."""
    bulk = f"{method}_where"
    count = validated(BulkAction, {"filter": selector, "dry_run": True}, "the filter")
    counted: BulkResult = output.call(lambda: _bulk_call(c, bulk, count))
    if dry_run or not counted.matched:
        if c.json or as_json:
            output.dump(counted)
        else:
            output.console.print(f"{counted.matched} tasks match; nothing done")
        return
    if not yes and not typer.confirm(
        f"{method} {min(counted.matched, limit)} of the {counted.matched} tasks that match?"
    ):
        raise typer.Exit(1)
    act = validated(BulkAction, {"filter": selector, "limit": limit}, "the filter")
    done: BulkResult = output.call(lambda: _bulk_call(c, bulk, act))
    if c.json or as_json:
        output.dump(done)
        return
    verb = {"retry": "retried", "cancel": "cancelled"}[method]
    more = "; more match: run it again" if done.more else ""
    output.console.print(f"{verb} {done.changed} of {done.matched} tasks{more}")
    if done.refused:
        why = output.safe(done.refusal)
        output.console.print(f"{done.refused} refused, as a submission would be: {why}")


async def _bulk_call(c: Ctx, method: str, action: BulkAction) -> BulkResult:
    async with c.core() as core:
        result: BulkResult = await getattr(core, method)(action)
        return result


#: the most a document (a submission, a definition) may hold: core's request body limit
#: (``CAIRN_MAX_BODY_BYTES``, 8 MiB by default), the most any of them would take anyway
MAX_DOCUMENT_BYTES = 8 * 1024 * 1024


def load_document(path: Path) -> Any:
    """A JSON or YAML file (by its suffix; YAML also reads JSON), read up to
    ``MAX_DOCUMENT_BYTES``: ``-f /dev/zero`` or a runaway file is refused, not read into
    memory without end."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        output.errors.print(f"[red]error[/red] cannot read {output.safe(path)}: {exc.strerror}")
        raise typer.Exit(2) from None
    if len(raw) > MAX_DOCUMENT_BYTES:
        output.errors.print(
            f"[red]error[/red] {output.safe(path)} is over {MAX_DOCUMENT_BYTES} bytes,"
            " more than a request may carry"
        )
        raise typer.Exit(2)
    try:
        text = raw.decode()
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        output.errors.print(
            f"[red]error[/red] {output.safe(path)} is not valid JSON or YAML: {output.safe(exc)}"
        )
        raise typer.Exit(2) from None


def validated(model: type[Any], data: Any, what: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        output.errors.print(f"[red]error[/red] {output.safe(what)} is invalid:")
        for err in exc.errors()[:20]:
            field = ".".join(str(p) for p in err["loc"])
            output.errors.print(f"  {output.safe(field)}: {output.safe(err['msg'])}")
        raise typer.Exit(2) from None


def sha256_of(uri: str) -> str | None:
    """The digest of a ``file://`` artifact, read locally in pieces; None for remote ones
    and for what is not a regular file (``file:///dev/zero`` was read without end)."""
    if not uri.startswith("file://"):
        return None
    try:
        with open(uri[len("file://") :], "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                return None
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError:
        return None


def task_rows(tasks: list[Task]) -> list[list[Any]]:
    return [
        [
            t.id,
            t.name,
            output.state(t.state),
            t.queue,
            t.owner,
            t.attempts,
            output.ago(t.created_at),
        ]
        for t in tasks
    ]


TASK_COLUMNS = ["id", "name", "state", "queue", "owner", "attempts", "created"]


def show_task(c: Ctx, task: Task) -> None:
    if c.json:
        output.dump(task)
        return
    rows: list[tuple[str, Any]] = [
        ("id", task.id),
        ("name", task.name),
        ("state", output.state(task.state)),
        ("owner", task.owner),
        ("queue", task.queue),
        ("priority", task.priority),
        ("artifact", task.artifact.uri),
        *_credentials_row(task),
        ("args", " ".join(task.args)),
        ("attempts", task.attempts),
        ("run at", output.when(task.run_at)),
        ("created", output.when(task.created_at)),
        ("labels", ", ".join(f"{k}={v}" for k, v in task.labels.items())),
    ]
    if task.resources.devices:
        devices = ", ".join(f"{n} {c}" for n, c in sorted(task.resources.devices.items()))
        rows.append(("devices", devices))
    if task.placement is not None:
        rows.append(("placement", _placement_text(task.placement)))
    rows += policy_rows(task)
    reason = getattr(task, "pending_reason", None)
    if reason:
        rows.append(("waiting because", reason))
    rows.extend(progress_rows(task))
    output.table(None, ["field", "value"], rows)


def _devices_option(text: str) -> dict[str, int]:
    try:
        return parse_devices(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--devices") from None


def _devices_used(used: dict[str, int], offered: dict[str, int]) -> str:
    return ", ".join(f"{n} {used.get(n, 0)}/{c}" for n, c in sorted(offered.items())) or "-"


def _placement_text(placement: Placement) -> str:
    parts = [f"requires {', '.join(placement.required)}"] if placement.required else []
    parts += [f"prefers {p.selector} ({p.weight})" for p in placement.preferred]
    if placement.spread:
        parts.append(f"spread by {placement.spread.by} (skew {placement.spread.max_skew})")
    if placement.anti_affinity:
        parts.append(f"one per {placement.anti_affinity}")
    return "; ".join(parts)


def _causes(causes: RetryCauses) -> str:
    parts = [f"exit {', '.join(map(str, causes.exit_codes))}"] if causes.exit_codes else []
    if causes.signals:
        parts.append(f"signal {', '.join(map(str, causes.signals))}")
    return "; ".join(parts)


def _seconds(value: float | None) -> str:
    return "none" if value is None else f"{value:g} s"


def policy_rows(task: Task) -> list[tuple[str, Any]]:
    """What a task may count on: its time limits and its retry policy."""
    retry = task.retry
    rows: list[tuple[str, Any]] = [
        ("timeout", _seconds(task.timeout_s)),
        ("start by", output.when(task.start_by) if task.start_by else "none"),
        (
            "retries",
            f"{retry.max_attempts} attempts, poison after {retry.poison_after} crashes"
            f" within {_seconds(retry.poison_window_s)}",
        ),
    ]
    if retry.never:
        rows.append(("never retried", _causes(retry.never)))
    if retry.always:
        rows.append(("always retried", _causes(retry.always)))
    return rows


NO_RETRY = NO_RETRY_EXIT_CODE
_UNSET = {
    "default-timeout": "default_timeout_s",
    "max-timeout": "max_timeout_s",
    "max-wait": "max_wait_s",
    "default-disk": "default_disk_mb",
    "max-disk": "max_disk_mb",
}


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _egress_change(mode: str | None, allow: list[str]) -> dict[str, Any] | None:
    """``--egress`` and ``--allow`` as the API's ``egress`` (``--allow`` alone: ``allow``)."""
    if mode is None and not allow:
        return None
    rules = []
    for item in allow:
        try:
            network, port = parse_destination(item)
        except ValueError as exc:
            output.errors.print(f"[red]error[/red] --allow: {exc}")
            raise typer.Exit(2) from None
        rules.append({"cidr": str(network), "port": port})
    return {"mode": mode or "allow", "allow": rules}


def _egress_shown(egress: Egress) -> str:
    if egress.mode != "allow":
        return egress.mode
    shown = [r.cidr if r.port is None else f"{r.cidr} port {r.port}" for r in egress.allow]
    return f"allow {', '.join(shown) or 'nothing'}"


def _queue_change(
    default_timeout: int | None,
    max_timeout: int | None,
    max_wait: int | None,
    unset: list[str],
    egress: dict[str, Any] | None = None,
    disk: tuple[int | None, int | None] = (None, None),
) -> QueueSettings:
    given = {
        "default_timeout_s": default_timeout,
        "max_timeout_s": max_timeout,
        "max_wait_s": max_wait,
        "default_disk_mb": disk[0],
        "max_disk_mb": disk[1],
        "egress": egress,
    }
    body: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    for name in unset:
        if name not in _UNSET:
            output.errors.print(f"[red]error[/red] --unset takes one of {', '.join(_UNSET)}")
            raise typer.Exit(2)
        body[_UNSET[name]] = None
    result: QueueSettings = validated(QueueSettings, body, "the queue's settings")
    return result


def _retry(
    retry: dict[str, Any],
    max_attempts: int | None,
    poison_window: float | None,
    never: tuple[list[int] | None, list[int] | None],
    always: tuple[list[int] | None, list[int] | None],
) -> dict[str, Any]:
    """The submission's retry policy with the flags' values added to the file's."""
    if max_attempts is not None:
        retry["max_attempts"] = max_attempts
    if poison_window is not None:
        retry["poison_window_s"] = poison_window
    for name, (codes, signals) in (("never", never), ("always", always)):
        listed = dict(retry.get(name, {}))
        if codes:
            listed["exit_codes"] = [*listed.get("exit_codes", []), *codes]
        if signals:
            listed["signals"] = [*listed.get("signals", []), *signals]
        if listed:
            retry[name] = listed
    return retry


def progress_text(found: TaskProgress | None) -> str | None:
    """``50% step 3 of 6 (attempt 12, 4s ago)``: what the task last said of its progress."""
    if found is None or found.updated_at is None:
        return None
    said = " ".join(
        part
        for part in (
            f"{found.fraction:.0%}" if found.fraction is not None else "",
            found.message or "",
        )
        if part
    )
    return f"{said or '(no message)'} (attempt {found.attempt_id}, {output.ago(found.updated_at)})"


def progress_rows(task: Task) -> list[tuple[str, Any]]:
    """What ``cairn show`` says of a task's progress, checkpoint and stall bound."""
    rows: list[tuple[str, Any]] = []
    found = task.progress
    said = progress_text(found)
    if said:
        rows.append(("progress", said))
    if found is not None and found.checkpoint_bytes is not None:
        rows.append(
            (
                "checkpoint",
                f"{found.checkpoint_bytes} bytes from attempt {found.checkpoint_attempt_id}, "
                f"{output.ago(found.checkpoint_at)}",
            )
        )
    if task.progress_timeout_s is not None:
        rows.append(("progress timeout", f"{task.progress_timeout_s} s without progress"))
    return rows


def _placement(
    body: dict[str, Any],
    select: list[str],
    prefer: list[str],
    spread_by: str | None,
    anti_affinity: str | None,
) -> None:
    """The placement flags into ``body["placement"]`` (core parses the selectors)."""
    if not (select or prefer or spread_by or anti_affinity):
        return
    placement = dict(body.get("placement") or {})
    if select:
        placement["required"] = [*placement.get("required", []), *select]
    for item in prefer:
        weight, colon, selector = item.partition(":")
        pair = {"selector": selector, "weight": int(weight)} if colon and weight.isdigit() else None
        entry = pair or {"selector": item}
        placement["preferred"] = [*placement.get("preferred", []), entry]
    if spread_by:
        placement["spread"] = {"by": spread_by}
    if anti_affinity:
        placement["anti_affinity"] = anti_affinity
    body["placement"] = placement


def _credentials_row(task: Task) -> list[tuple[str, str]]:
    """The secret an artifact is fetched with, as ``--artifact-credentials`` takes it."""
    ref = task.artifact.credentials
    if ref is None:
        return []
    return [("artifact keys", f"{ref.team}/{ref.secret}" if ref.team else ref.secret)]


def _ref(text: str) -> dict[str, str]:
    """A secret reference from ``SECRET`` (yours) or ``TEAM/SECRET`` (a team's)."""
    team, _, name = text.rpartition("/")
    return {"secret": name, "team": team} if team else {"secret": name}


def register(app: typer.Typer) -> None:  # noqa: C901 - one block of small commands
    @app.command()
    def submit(  # noqa: C901 - one flag, one line each
        ctx: typer.Context,
        name: Annotated[str | None, typer.Argument(help="the task's name")] = None,
        artifact: Annotated[
            str | None, typer.Option(help="executable URI: s3://, https:// or file://")
        ] = None,
        sha256: Annotated[
            str | None, typer.Option(help="the artifact's digest (read locally for file://)")
        ] = None,
        artifact_credentials: Annotated[
            str | None,
            typer.Option(
                help="SECRET or TEAM/SECRET: S3 keys the worker fetches an s3:// artifact with"
            ),
        ] = None,
        arg: Annotated[list[str] | None, typer.Option("--arg", "-a", help="an argument")] = None,
        queue: Annotated[str, typer.Option(help="queue")] = "default",
        priority: Annotated[int, typer.Option(help="-100..100")] = 0,
        env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE")] = None,
        secret: Annotated[
            list[str] | None,
            typer.Option(help="KEY=SECRET, or KEY=TEAM/SECRET: env KEY from a stored secret"),
        ] = None,
        team: Annotated[str | None, typer.Option(help="share it with this team")] = None,
        label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE")] = None,
        select: Annotated[
            list[str] | None,
            typer.Option(help="a worker label it requires: disk=ssd, 'zone in (a,b)', gpu exists"),
        ] = None,
        prefer: Annotated[
            list[str] | None,
            typer.Option(help="a worker label it prefers, weight 1, or WEIGHT:SELECTOR (5:zone=b)"),
        ] = None,
        spread_by: Annotated[
            str | None,
            typer.Option(help="spread its running replicas (same name) across this label or host"),
        ] = None,
        anti_affinity: Annotated[
            str | None,
            typer.Option(help="never two running replicas on one value of this label (or host)"),
        ] = None,
        cpu: Annotated[float | None, typer.Option(help="CPU request")] = None,
        memory_mb: Annotated[int | None, typer.Option(help="memory request, MB")] = None,
        devices: Annotated[str | None, typer.Option(help="devices request: gpu=1")] = None,
        disk_mb: Annotated[
            int | None, typer.Option(help="disk quota of its home and /tmp, MB (a tmpfs)")
        ] = None,
        key: Annotated[str | None, typer.Option(help="idempotency key")] = None,
        timeout: Annotated[
            int | None, typer.Option(help="seconds an attempt may run (default: its queue's)")
        ] = None,
        start_by: Annotated[
            str | None, typer.Option(help="ISO time: dead if not started by then")
        ] = None,
        max_wait: Annotated[
            int | None, typer.Option(help="seconds it may wait to start, from when it is due")
        ] = None,
        progress_timeout: Annotated[
            int | None,
            typer.Option(help="end an attempt that reports no progress for this many seconds"),
        ] = None,
        max_attempts: Annotated[int | None, typer.Option(help="attempts in all, 1..100")] = None,
        no_retry_exit: Annotated[
            list[int] | None, typer.Option(help=f"an exit code never retried (also {NO_RETRY})")
        ] = None,
        retry_exit: Annotated[
            list[int] | None, typer.Option(help="an exit code always retried (spends no attempt)")
        ] = None,
        no_retry_signal: Annotated[
            list[int] | None, typer.Option(help="a signal never retried")
        ] = None,
        retry_signal: Annotated[
            list[int] | None, typer.Option(help="a signal always retried")
        ] = None,
        poison_window: Annotated[
            float | None, typer.Option(help="seconds within which crashes count (default 72 h)")
        ] = None,
        file: Annotated[
            Path | None, typer.Option("--file", "-f", help="a submission as JSON or YAML")
        ] = None,
        wait: Annotated[bool, typer.Option(help="wait until it ends")] = False,
        as_json: JsonFlag = False,
    ) -> None:
        """Submit one task (from flags, or a JSON/YAML file)."""
        c = ctx_of(ctx)
        c.json = c.json or as_json
        body: dict[str, Any] = dict(load_document(file)) if file else {}
        if name:
            body["name"] = name
        if artifact:
            body["artifact"] = {"uri": artifact, "sha256": sha256 or sha256_of(artifact)}
        if artifact_credentials:
            body["artifact"] = {
                **body.get("artifact", {}),
                "credentials": _ref(artifact_credentials),
            }
        if arg:
            body["args"] = list(arg)
        if queue != "default" or "queue" not in body:
            body["queue"] = queue
        if priority:
            body["priority"] = priority
        if env:
            body["env"] = output.pairs(env)
        for key, ref in output.pairs(secret or []).items():
            body["env"] = {**body.get("env", {}), key: _ref(ref)}
        if team:
            body["team"] = team
        if label:
            body["labels"] = output.pairs(label)
        _placement(body, select or [], prefer or [], spread_by, anti_affinity)
        asked = {"cpu": cpu, "memory_mb": memory_mb, "disk_mb": disk_mb}
        if any(v is not None for v in asked.values()) or devices is not None:
            resources = dict(body.get("resources", {}))
            resources.update({k: v for k, v in asked.items() if v is not None})
            if devices is not None:
                resources["devices"] = _devices_option(devices)
            body["resources"] = resources
        if key:
            body["idempotency_key"] = key
        limits = {
            "timeout_s": timeout,
            "start_by": _utc(start_by),
            "max_wait_s": max_wait,
            "progress_timeout_s": progress_timeout,
        }
        body.update({k: v for k, v in limits.items() if v is not None})
        body["retry"] = _retry(
            dict(body.get("retry", {})),
            max_attempts,
            poison_window,
            never=(no_retry_exit, no_retry_signal),
            always=(retry_exit, retry_signal),
        )
        spec: TaskCreate = validated(TaskCreate, body, "the submission")

        async def go() -> Task:
            async with c.core() as core:
                task, _ = await core.submit(spec)
                return task

        task = output.call(go)
        if wait:
            wait_tasks(c, [task.id])
            task = output.call(lambda: _get(c, task.id))
        if c.json:
            output.dump(task)
        else:
            output.console.print(f"task [bold]{task.id}[/bold] {output.state(task.state)}")

    @app.command()
    def get(ctx: typer.Context, task_id: int, as_json: JsonFlag = False) -> None:
        """Show one task."""
        c = ctx_of(ctx)
        c.json = c.json or as_json
        show_task(c, output.call(lambda: _get(c, task_id)))

    app.command("show", help="Show one task (as get): its progress and checkpoint too.")(get)

    @app.command("ls")
    def list_tasks(
        ctx: typer.Context,
        state: Annotated[TaskState | None, typer.Option(help="only this state")] = None,
        queue: Annotated[str | None, typer.Option()] = None,
        label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE")] = None,
        limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
        as_json: JsonFlag = False,
    ) -> None:
        """List tasks, newest first."""
        c = ctx_of(ctx)
        labels = output.pairs(label) if label else None

        async def go() -> list[Task]:
            async with c.core() as core:
                page = await core.list_tasks(state=state, queue=queue, labels=labels, limit=limit)
                return page.items

        tasks = output.call(go)
        if c.json or as_json:
            output.dump(tasks)
        else:
            output.table(None, TASK_COLUMNS, task_rows(tasks))

    def each(method: str, doc: str) -> None:
        def command(
            ctx: typer.Context,
            task_ids: Annotated[list[int] | None, typer.Argument(help="task ids")] = None,
            state: Annotated[TaskState | None, typer.Option(help="with a filter")] = None,
            queue: Annotated[str | None, typer.Option()] = None,
            label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE")] = None,
            owner: Annotated[str | None, typer.Option(help="another owner's (admins)")] = None,
            team: Annotated[str | None, typer.Option(help="a team's (its members)")] = None,
            created_after: Annotated[str | None, typer.Option(help="ISO time")] = None,
            created_before: Annotated[str | None, typer.Option(help="ISO time")] = None,
            finished_after: Annotated[str | None, typer.Option(help="ISO time")] = None,
            finished_before: Annotated[str | None, typer.Option(help="ISO time")] = None,
            limit: Annotated[int, typer.Option(min=1, max=10_000)] = 1000,
            dry_run: Annotated[bool, typer.Option("--dry-run", help="only count")] = False,
            yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask")] = False,
            as_json: JsonFlag = False,
        ) -> None:
            c = ctx_of(ctx)
            chosen = {
                "state": state,
                "queue": queue,
                "owner": owner,
                "team": team,
                "labels": output.pairs(label) if label else None,
                "created_after": _utc(created_after),
                "created_before": _utc(created_before),
                "finished_after": _utc(finished_after),
                "finished_before": _utc(finished_before),
            }
            selector = {k: v for k, v in chosen.items() if v is not None}
            if task_ids and selector:
                output.errors.print("[red]error[/red] name task ids or a filter, not both")
                raise typer.Exit(2)
            if task_ids:
                _each_task(c, method, task_ids, as_json)
            elif selector:
                _by_filter(c, method, selector, limit, dry_run, yes, as_json)
            else:
                output.errors.print(
                    f"[red]error[/red] name task ids, or a filter (--state, --queue, --label, "
                    f"...) to {method} every task it selects"
                )
                raise typer.Exit(2)

        command.__doc__ = doc
        app.command(method)(command)

    each("cancel", "Cancel tasks: by id, or every unfinished task a filter selects.")
    each("retry", "Retry failed, dead or cancelled tasks: by id, or every one a filter selects.")

    @app.command()
    def logs(
        ctx: typer.Context,
        task_id: int,
        follow: Annotated[
            bool,
            typer.Option(
                "--follow", "-f", help="print lines as they are written until the task ends"
            ),
        ] = False,
        raw: Annotated[
            bool,
            typer.Option(
                "--raw",
                help="print control characters as they are, escape sequences included "
                "(by default each is shown as \\xNN)",
            ),
        ] = False,
    ) -> None:
        """Print a task's log (its latest attempt's, also while it runs). With -f, keep
        printing lines as they are written, through retries, until the task ends.
        Control characters but newline and tab are shown escaped (ESC as \\x1b): the
        task wrote them, not you; --raw passes them to the terminal."""
        c = ctx_of(ctx)
        show = _as_is if raw else output.visible
        if follow:
            output.call(lambda: _follow_log(c, task_id, show))
            return
        text, task = output.call(lambda: _log(c, task_id))
        text = show(text)
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        said = progress_text(task.progress)
        if said:
            output.errors.print(f"progress: {output.safe(said)}")

    @app.command()
    def workers(ctx: typer.Context, as_json: JsonFlag = False) -> None:
        """Workers, their capacity, use and heartbeat."""
        c = ctx_of(ctx)

        async def go() -> Any:
            async with c.core() as core:
                return await core.workers()

        found = output.call(go)
        if c.json or as_json:
            output.dump(found)
            return
        output.table(
            None,
            [
                "id",
                "host",
                "state",
                "queues",
                "cpu used/cap",
                "memory MB used/cap",
                "devices used/cap",
                "running",
                "heartbeat",
                "turn",
            ],
            [
                [
                    w.id,
                    w.hostname,
                    output.state(w.state),
                    ",".join(w.queues),
                    f"{w.used_cpu:g}/{w.cpu:g}",
                    f"{w.used_memory_mb}/{w.memory_mb}",
                    output.safe(_devices_used(w.used_devices, w.devices)),
                    w.running,
                    output.ago(w.last_heartbeat_at),
                    output.ago(w.last_turn_at),
                ]
                for w in found
            ],
        )

    @app.command()
    def queues(
        ctx: typer.Context,
        name: Annotated[str | None, typer.Argument(help="a queue to set (admin)")] = None,
        default_timeout: Annotated[
            int | None, typer.Option(help="set the timeout_s of its tasks that set none")
        ] = None,
        max_timeout: Annotated[
            int | None, typer.Option(help="set the largest timeout_s a task may ask for")
        ] = None,
        max_wait: Annotated[
            int | None, typer.Option(help="set the seconds a task may wait to start")
        ] = None,
        default_disk: Annotated[
            int | None, typer.Option(help="set the disk quota (MB) of its tasks that ask none")
        ] = None,
        max_disk: Annotated[
            int | None, typer.Option(help="set the largest disk quota (MB) a task may ask")
        ] = None,
        unset: Annotated[
            list[str] | None,
            typer.Option(
                help="back to no limit: default-timeout, max-timeout, max-wait, default-disk, "
                "max-disk"
            ),
        ] = None,
        egress: Annotated[
            str | None,
            typer.Option(
                help="what its attempts' network may reach: host (the default: all but "
                "link-local and the database), none (loopback only), allow (--allow only)"
            ),
        ] = None,
        allow: Annotated[
            list[str] | None,
            typer.Option(help="with --egress allow: CIDR[:PORT] or [IPV6/LEN]:PORT, repeated"),
        ] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Queues with their depth per state, their tasks' time limits and egress policy;
        with NAME and options, set that queue's (admin; a default above the maximum is
        refused)."""
        c = ctx_of(ctx)
        change = _queue_change(
            default_timeout,
            max_timeout,
            max_wait,
            unset or [],
            _egress_change(egress, allow or []),
            (default_disk, max_disk),
        )
        if change.model_fields_set and name is None:
            output.errors.print("[red]error[/red] name the queue to set")
            raise typer.Exit(2)

        async def go() -> Any:
            async with c.core() as core:
                if name is not None and change.model_fields_set:
                    await core.set_queue(name, change)
                found = await core.queues()
                return [q for q in found if name is None or q.name == name]

        found = output.call(go)
        if c.json or as_json:
            output.dump(found)
            return
        # Core counts every unfinished state and dead (the ended tasks that want someone's
        # look); succeeded and cancelled ones are not counted per queue.
        shown = [s for s in TaskState if s not in FINAL or s is TaskState.DEAD]
        output.table(
            None,
            [
                "queue",
                "paused",
                *(s.value for s in shown),
                "oldest waiting s",
                "timeout s (default/max)",
                "max wait s",
                "disk MB (default/max)",
                "egress",
            ],
            [
                [
                    q.name,
                    "yes" if q.paused else "",
                    *(q.depth.get(s, 0) for s in shown),
                    f"{q.oldest_waiting_age_s:.0f}" if q.oldest_waiting_age_s is not None else "",
                    f"{_or_dash(q.default_timeout_s)}/{_or_dash(q.max_timeout_s)}",
                    _or_dash(q.max_wait_s),
                    f"{_or_dash(q.default_disk_mb)}/{_or_dash(q.max_disk_mb)}",
                    _egress_shown(q.egress),
                ]
                for q in found
            ],
        )

    @app.command()
    def wait(
        ctx: typer.Context,
        task_ids: list[int],
        timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 3600,
    ) -> None:
        """Wait for tasks to end, with a live display; exit 1 if any did not succeed."""
        c = ctx_of(ctx)
        ended = wait_tasks(c, task_ids, timeout)
        bad = [t for t in ended if t.state != TaskState.SUCCEEDED]
        for task in bad:
            output.errors.print(f"task {task.id} {output.state(task.state)}")
        if bad or len(ended) < len(task_ids):
            raise typer.Exit(1)


async def _get(c: Ctx, task_id: int) -> Task:
    async with c.core() as core:
        return await core.get_task(task_id)


async def _events(c: Ctx, task_id: int) -> Any:
    async with c.core() as core:
        return await core.task_events(task_id)


async def _log(c: Ctx, task_id: int) -> tuple[str, Task]:
    async with c.core() as core:
        return await core.log(task_id), await core.get_task(task_id)


def _as_is(text: str) -> str:
    return text


async def _follow_log(c: Ctx, task_id: int, show: Callable[[str], str]) -> None:
    """Like ``kubectl logs -f``: each attempt's lines as they are written (through
    ``show``); between attempts (a retry), a note on stderr, and so is each new word of
    the task's progress; back when the task is final."""
    async with c.core() as core:
        watching = asyncio.create_task(_follow_progress(core, task_id))
        try:
            await _follow_pieces(core, task_id, show)
        finally:
            watching.cancel()


PROGRESS_POLL_S = 2.0


async def _follow_progress(core: CoreClient, task_id: int) -> None:
    """Print the task's progress on stderr each time it changes."""
    last = None
    while True:
        try:
            found = (await core.get_task(task_id)).progress
        except (httpx.HTTPError, CairnError):
            await asyncio.sleep(PROGRESS_POLL_S)  # the log's own stream says what broke
            continue
        stamp = found.updated_at if found is not None else None
        if stamp is not None and stamp != last:
            output.errors.print(f"progress: {output.safe(progress_text(found) or '')}")
            last = stamp
        await asyncio.sleep(PROGRESS_POLL_S)


async def _follow_pieces(core: CoreClient, task_id: int, show: Callable[[str], str]) -> None:
    """Each attempt's log, through its retries, until the task is final."""
    attempt: int | None = None
    offset = 0
    while True:
        end: LogEnd | None = None
        async for item in core.follow_log(task_id, attempt, offset):
            if isinstance(item, LogEnd):
                end = item
            else:
                sys.stdout.write(show(item.text))
                sys.stdout.flush()
                attempt, offset = item.attempt_id, item.next_offset
        if end is None:  # the stream broke off: go on from where it stopped
            continue
        if end.attempt_id is not None:
            output.errors.print(
                f"attempt {end.attempt_id} ended: {output.safe(end.outcome)}; "
                f"task {output.state(end.task_state)}"
            )
        if end.task_state in FINAL or end.attempt_id is None:
            return
        attempt, offset = await _next_attempt(core, task_id, end.attempt_id), 0
        if attempt is None:
            return


async def _next_attempt(core: CoreClient, task_id: int, after: int) -> int | None:
    """The attempt after ``after`` once it starts; None if the task ends first."""
    while True:
        newer = [a.id for a in await core.attempts(task_id) if a.id > after]
        if newer:
            return min(newer)
        if (await core.get_task(task_id)).state in FINAL:
            return None
        await asyncio.sleep(0.5)


def wait_tasks(c: Ctx, task_ids: list[int], timeout: float = 3600) -> list[Task]:
    """Poll until every task is final (or ``timeout``); a progress bar on a terminal."""

    async def snapshot() -> list[Task]:
        async with c.core() as core:
            return list(await asyncio.gather(*(core.get_task(t) for t in task_ids)))

    deadline = time.monotonic() + timeout
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=output.errors,
        transient=True,
    )
    bar = progress.add_task("tasks ended", total=len(task_ids))
    with Live(progress, console=output.errors, transient=True, redirect_stdout=False):
        while True:
            tasks = output.call(snapshot)
            done = [t for t in tasks if t.state in FINAL]
            counts: dict[str, int] = {}
            for t in tasks:
                counts[t.state] = counts.get(t.state, 0) + 1
            summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            progress.update(bar, completed=len(done), description=summary)
            if len(done) == len(tasks) or time.monotonic() > deadline:
                return done
            time.sleep(0.5)
