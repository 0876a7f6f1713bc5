"""``cairn notify ...``: webhook subscriptions for your tasks, runs and schedules."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cairn import output
from cairn.tasks_cli import JsonFlag, ctx_of, validated
from libs.common.models import Subscription, SubscriptionCreate

app = typer.Typer(
    help="Webhook notifications: add, ls, rm, test, enable, log.", no_args_is_help=True
)

EVENTS = "task.dead, task.deadline_missed, run.failed, fire.missed, fire.failed, approval.waiting"
COLUMNS = ["id", "name", "events", "filter", "url", "status"]


def _rows(items: list[Subscription]) -> list[list[Any]]:
    def where(s: Subscription) -> str:
        parts = [f"queue={s.filter.queue}"] if s.filter.queue else []
        return " ".join(parts + [f"{k}={v}" for k, v in s.filter.labels.items()])

    def status(s: Subscription) -> output.Markup:
        if not s.enabled:
            return output.Markup(f"[red]disabled[/red]: {output.safe(s.disabled_reason)}")
        failing = f"[yellow]{s.failures} failing[/yellow]" if s.failures else "[green]ok[/green]"
        return output.Markup(failing)

    return [[s.id, s.name, ", ".join(s.events), where(s), s.url, status(s)] for s in items]


@app.command("add")
def add(
    ctx: typer.Context,
    name: str,
    url: Annotated[
        str, typer.Argument(help="the webhook: https://... (http:// outside production)")
    ],
    event: Annotated[
        list[str] | None, typer.Option("--event", "-e", help=f"repeatable: {EVENTS}")
    ] = None,
    queue: Annotated[str | None, typer.Option(help="only tasks of this queue")] = None,
    label: Annotated[
        list[str] | None, typer.Option("--label", "-l", help="only tasks with KEY=VALUE")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Subscribe a webhook (default event: task.dead). Prints the signing secret once."""
    body = validated(
        SubscriptionCreate,
        {
            "name": name,
            "url": url,
            "events": event or ["task.dead"],
            "filter": {"queue": queue, "labels": output.pairs(label or [])},
        },
        "the subscription",
    )

    async def go() -> Any:
        async with ctx_of(ctx).core() as core:
            return await core.create_subscription(body)

    made = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(made)
        return
    output.console.print(
        f"subscription [bold]{made.id}[/bold] {output.safe(made.name)}: "
        f"{output.safe(', '.join(made.events))}"
    )
    output.console.print(
        f"signing secret (shown once; verify X-Cairn-Signature with it): {made.secret}",
        soft_wrap=True,
    )


@app.command("ls")
def list_subscriptions(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Your subscriptions and whether they deliver."""

    async def go() -> list[Subscription]:
        async with ctx_of(ctx).core() as core:
            return await core.subscriptions()

    items = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(items)
    else:
        output.table(None, COLUMNS, _rows(items))


@app.command("rm")
def remove(ctx: typer.Context, subscription_id: int) -> None:
    """Delete a subscription and its pending deliveries."""

    async def go() -> None:
        async with ctx_of(ctx).core() as core:
            await core.delete_subscription(subscription_id)

    output.call(go)
    output.console.print(f"subscription {subscription_id} deleted")


@app.command("test")
def test(ctx: typer.Context, subscription_id: int, as_json: JsonFlag = False) -> None:
    """Send a test event to the webhook; `cairn notify log` shows its answer."""

    async def go() -> Any:
        async with ctx_of(ctx).core() as core:
            return await core.test_subscription(subscription_id)

    queued = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(queued)
    else:
        output.console.print(f"test delivery {queued.delivery_id} queued")


@app.command("enable")
def enable(ctx: typer.Context, subscription_id: int) -> None:
    """Deliver again to a subscription that was disabled after failures."""

    async def go() -> Subscription:
        async with ctx_of(ctx).core() as core:
            return await core.enable_subscription(subscription_id)

    output.table(None, COLUMNS, _rows([output.call(go)]))


@app.command("log")
def log(
    ctx: typer.Context,
    subscription_id: int,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
    as_json: JsonFlag = False,
) -> None:
    """The webhook's newest answers, one per try."""

    async def go() -> Any:
        async with ctx_of(ctx).core() as core:
            return await core.answers(subscription_id, limit)

    answers = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(answers)
        return
    output.table(
        None,
        ["at", "delivery", "event", "try", "status", "ms", "error"],
        [
            [
                output.when(a.at),
                str(a.delivery_id),
                a.event,
                a.try_,
                a.status or "",
                f"{a.duration_ms:.0f}",
                a.error or "",
            ]
            for a in answers
        ],
    )
