"""The ``cairn`` command.

Running Cairn: ``up`` (everything, on loopback), ``core``, ``cron``, ``dag``, ``worker``,
``migrate``. Using it: ``submit``, ``get``, ``ls``, ``cancel``, ``retry``, ``logs``,
``wait``, ``workers``, ``queues``, ``cron ...``, ``dag ...``, ``token ...``, ``team ...``,
``secret ...``, ``audit``, ``notify ...``, ``service ...``; ``login``, ``logout``, ``whoami``.
Tables by default, ``--json`` for scripts. See ``cairn/config.py`` for where the URLs and
the token come from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cairn import (
    config,
    cron_cli,
    dag_cli,
    identity_cli,
    login_cli,
    notify_cli,
    output,
    placement_cli,
    services_cli,
    sharing_cli,
    system,
    tasks_cli,
)
from cairn.tasks_cli import Ctx
from libs.common.settings import CairnSettings

app = typer.Typer(
    name="cairn",
    help="Cairn: single tasks, cron schedules and DAG workflows on PostgreSQL.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.callback()
def root(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(help="core's URL (CAIRN_URL)")] = None,
    cron_url: Annotated[str | None, typer.Option(help="cron's URL (CAIRN_CRON_URL)")] = None,
    dag_url: Annotated[
        str | None, typer.Option(help="the DAG service's URL (CAIRN_DAG_URL)")
    ] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (CAIRN_TOKEN)")] = None,
    home: Annotated[Path | None, typer.Option(help="data directory (CAIRN_HOME)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    if ctx.invoked_subcommand == "worker":
        return  # the agent reads its own settings (WorkerSettings: no database URL)
    settings = config.load(url=url, cron_url=cron_url, dag_url=dag_url, token=token, home=home)
    ctx.obj = Ctx(settings=settings, json=as_json)


def _settings(ctx: typer.Context) -> CairnSettings:
    return tasks_cli.ctx_of(ctx).settings


@app.command()
def up(
    ctx: typer.Context,
    demo: Annotated[
        bool, typer.Option(help="also load a few tasks, a cron schedule and a workflow")
    ] = False,
) -> None:
    """Start the whole system on loopback: embedded PostgreSQL (unless CAIRN_DATABASE_URL
    is set), core, cron, dag and a worker. Ctrl-C stops everything; the data stays."""

    def loaded(urls: dict[str, str], token: str) -> None:
        if not demo:
            return
        from cairn.demo import load_sync

        made = load_sync(urls, token)
        print(
            f"demo loaded: tasks {', '.join(map(str, made['tasks']))}; "
            f"schedule {made['schedule']} (every minute); workflow run {made['run']}\n"
            f"  cairn ls    cairn dag status {made['run']}    cairn cron next {made['schedule']}",
            flush=True,
        )

    raise typer.Exit(system.up(_settings(ctx), loaded))


def _serve(module: str, argv: list[str]) -> None:
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    main(argv)


@app.command(context_settings=PASS_THROUGH)
def core(ctx: typer.Context) -> None:
    """Run core's API and loops (flags: --port, --host)."""
    _serve("services.core", ctx.args)


@app.command(context_settings=PASS_THROUGH)
def worker(ctx: typer.Context) -> None:
    """Run a worker agent (CAIRN_URL, CAIRN_TOKEN of a worker principal)."""
    from services.worker.agent import main

    main(ctx.args)


def _service_group(group: typer.Typer, module: str, what: str) -> None:
    @group.callback(invoke_without_command=True, context_settings=PASS_THROUGH)
    def serve(ctx: typer.Context) -> None:
        if ctx.invoked_subcommand is None:
            _serve(module, ctx.args)

    serve.__doc__ = f"With no command: run {what} (flags: --port, --host)."


_service_group(cron_cli.app, "services.cron", "the cron service")
_service_group(dag_cli.app, "services.dag", "the DAG service")
app.add_typer(cron_cli.app, name="cron")
app.add_typer(dag_cli.app, name="dag")
app.add_typer(notify_cli.app, name="notify")
app.add_typer(services_cli.app, name="service")


@app.command()
def migrate(ctx: typer.Context) -> None:
    """Migrate every service's schema to its newest version."""
    from libs.common import logs

    settings = _settings(ctx)
    # what the migrations say as they go (each step; whom an index build waits for)
    logs.setup("migrate", settings.log_level)
    system.prepare_home(settings)
    url, started = system.database(settings)
    try:
        system.migrate_or_exit(settings.direct_url(url))
    finally:
        if started is not None:
            started.stop()
    output.console.print("every schema is at its newest migration")


tasks_cli.register(app)
identity_cli.register(app)
login_cli.register(app)
placement_cli.register(app)
placement_cli.register_usage(app)
sharing_cli.register(app)


def main() -> None:
    app()
