"""``cairn service ...``: services kept at N replicas, rolled to a new template and rolled
back by core's controller (docs/services.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from cairn import output
from cairn.tasks_cli import JsonFlag, ctx_of, load_document, sha256_of, validated
from libs.common.models import Endpoint, ServiceChange, ServiceCreate, ServiceInfo

app = typer.Typer(
    help="Services kept at N replicas with rolling updates: create, ls, get, set, rm.",
    no_args_is_help=True,
)

COLUMNS = ["name", "revision", "rollout", "ready", "live", "message"]
#: the controller's steps ``get`` shows
STEPS_SHOWN = 10

TemplateFile = Annotated[
    Path | None,
    typer.Option("--file", "-f", help="the template: a kind: service submission as JSON or YAML"),
]
Artifact = Annotated[str | None, typer.Option(help="the artifact's URI (replaces the template's)")]
Sha256 = Annotated[
    str | None, typer.Option(help="the artifact's sha-256 (read locally for file://)")
]
MaxSurge = Annotated[int | None, typer.Option(help="replicas above the count while rolling")]
MaxUnavailable = Annotated[
    int | None, typer.Option(help="ready replicas below the count while rolling")
]
Deadline = Annotated[
    int | None, typer.Option("--deadline", help="seconds for a rollout's replicas to get ready")
]
MaxFailures = Annotated[
    int | None, typer.Option(help="failures of a rollout's new replicas that roll it back")
]


def _template(
    base: dict[str, Any], file: Path | None, artifact: str | None, sha256: str | None
) -> dict[str, Any] | None:
    """The template from ``base`` (the service's, on a change), the file's, and a new
    artifact; None when neither is given."""
    if file is None and artifact is None:
        return None
    template = dict(load_document(file)) if file else dict(base)
    template.setdefault("kind", "service")
    if artifact:
        template["artifact"] = {"uri": artifact, "sha256": sha256 or sha256_of(artifact)}
    return template


def _rollout(body: dict[str, Any], base: dict[str, Any], *given: int | None) -> None:
    """Put ``base`` with the rollout options given (max surge, max unavailable, deadline,
    max failures) into ``body``; nothing when none is given."""
    names = ("max_surge", "max_unavailable", "deadline_s", "max_failures")
    chosen = {k: v for k, v in zip(names, given, strict=True) if v is not None}
    if chosen:
        body["rollout"] = {**base, **chosen}


def _readiness(s: ServiceInfo) -> str:
    return f"{s.ready}/{s.replicas}"


def _rows(items: list[ServiceInfo]) -> list[list[Any]]:
    return [
        [s.name, s.revision, output.state(s.rollout_state), _readiness(s), s.live, s.message]
        for s in items
    ]


def _where(e: Endpoint) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(e.endpoints.items())) or "-"


def _show(service: ServiceInfo, endpoints: list[Endpoint]) -> None:
    rollout = service.rollout
    output.table(
        None,
        ["field", "value"],
        [
            ("name", service.name),
            ("owner", service.owner),
            ("revision", service.revision),
            ("artifact", service.template.artifact.uri),
            ("rollout", output.state(service.rollout_state)),
            ("message", service.message or ""),
            ("ready", f"{_readiness(service)} of revision {service.revision}"),
            ("live", f"{service.live} ({service.current} of revision {service.revision})"),
            (
                "policy",
                f"max surge {rollout.max_surge}, max unavailable {rollout.max_unavailable}, "
                f"deadline {rollout.deadline_s} s, max failures {rollout.max_failures}",
            ),
            ("updated", output.when(service.updated_at)),
        ],
    )
    output.table(
        "replicas",
        ["task", "attempt", "ready", "endpoints"],
        [[e.task_id, e.attempt_id, "yes" if e.ready else "no", _where(e)] for e in endpoints],
    )
    steps = service.steps[-STEPS_SHOWN:]
    output.table(
        "last steps",
        ["at", "step", "detail"],
        [[output.when(s.at), s.step, s.detail] for s in steps],
    )


def _answer(ctx: typer.Context, as_json: bool, service: ServiceInfo, markup: str) -> None:
    """The service as JSON, or a line of rich ``markup`` after its name."""
    if ctx_of(ctx).json or as_json:
        output.dump(service)
    else:
        output.console.print(f"service [bold]{output.safe(service.name)}[/bold]: {markup}")


@app.command("create")
def create(
    ctx: typer.Context,
    name: str,
    file: TemplateFile = None,
    artifact: Artifact = None,
    sha256: Sha256 = None,
    replicas: Annotated[int, typer.Option(help="replicas to keep running")] = 1,
    max_surge: MaxSurge = None,
    max_unavailable: MaxUnavailable = None,
    deadline: Deadline = None,
    max_failures: MaxFailures = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a service from a template file (and/or an artifact); core's controller
    starts its replicas."""
    template = _template({"name": name}, file, artifact, sha256)
    if template is None:
        output.errors.print("[red]error[/red] give the template (--file) or an --artifact")
        raise typer.Exit(2)
    body: dict[str, Any] = {"name": name, "replicas": replicas, "template": template}
    _rollout(body, {}, max_surge, max_unavailable, deadline, max_failures)
    spec = validated(ServiceCreate, body, "the service")

    async def go() -> ServiceInfo:
        async with ctx_of(ctx).core() as core:
            return await core.create_service(spec)

    made = output.call(go)
    _answer(ctx, as_json, made, f"created: revision {made.revision}, {made.replicas} replicas")


@app.command("ls")
def list_services(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Your services: revision, rollout, ready replicas of the current revision."""

    async def go() -> list[ServiceInfo]:
        async with ctx_of(ctx).core() as core:
            return await core.services()

    items = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(items)
    else:
        output.table(None, COLUMNS, _rows(items))


@app.command("get")
def get(ctx: typer.Context, name: str, as_json: JsonFlag = False) -> None:
    """A service: its revision and rollout, its replicas (ready or not, and where they
    listen) and the controller's last steps."""

    async def go() -> tuple[ServiceInfo, list[Endpoint]]:
        async with ctx_of(ctx).core() as core:
            service = await core.service(name)
            found = await core.endpoints(name, only_ready=False)
            return service, [e for e in found if e.owner == service.owner]

    service, endpoints = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump({**service.model_dump(mode="json"), "endpoints": endpoints})
        return
    _show(service, endpoints)


@app.command("set")
def change(
    ctx: typer.Context,
    name: str,
    replicas: Annotated[int | None, typer.Option(help="replicas to keep running")] = None,
    file: TemplateFile = None,
    artifact: Artifact = None,
    sha256: Sha256 = None,
    max_surge: MaxSurge = None,
    max_unavailable: MaxUnavailable = None,
    deadline: Deadline = None,
    max_failures: MaxFailures = None,
    as_json: JsonFlag = False,
) -> None:
    """Change a service: its count, its rollout policy, or its template (a new file, or
    the current template with a new --artifact), which is rolled out and rolled back if
    its replicas fail."""

    async def go() -> ServiceInfo:
        async with ctx_of(ctx).core() as core:
            now = await core.service(name)
            current = now.template.model_dump(mode="json", exclude_defaults=True)
            body: dict[str, Any] = {}
            if replicas is not None:
                body["replicas"] = replicas
            template = _template(current, file, artifact, sha256)
            if template is not None:
                body["template"] = template
            rollout = now.rollout.model_dump()
            _rollout(body, rollout, max_surge, max_unavailable, deadline, max_failures)
            if not body:
                return now
            return await core.change_service(name, validated(ServiceChange, body, "the change"))

    changed = output.call(go)
    said = f"revision {changed.revision}, {changed.replicas} replicas, rollout "
    _answer(ctx, as_json, changed, said + output.state(changed.rollout_state))


@app.command("rm")
def remove(ctx: typer.Context, name: str) -> None:
    """Delete a service; its replicas are cancelled."""

    async def go() -> None:
        async with ctx_of(ctx).core() as core:
            await core.delete_service(name)

    output.call(go)
    output.console.print(f"service {output.safe(name)} deleted")
