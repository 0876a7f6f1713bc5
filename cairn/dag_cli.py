"""``cairn dag ...``: workflows and their runs in the DAG service. (``cairn dag serve``
runs the service itself.)"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.live import Live
from rich.tree import Tree

from cairn import output, sdk
from cairn.tasks_cli import JsonFlag, ctx_of, load_document, validated
from libs.common.dag_client import DagClient
from libs.common.dag_models import (
    EventDelivery,
    Node,
    NodeState,
    Run,
    RunEvent,
    TriggerCreate,
    TriggerCreated,
    Workflow,
    WorkflowCreate,
)

app = typer.Typer(
    help="Workflows: submit FILE.yaml, apply FILE.py, ls, run, status, outputs, cancel, retry, "
    "clear, approve, reject, signal, graph, trigger."
)
trigger_app = typer.Typer(help="Signed HTTP triggers of a workflow: create, list, delete.")
app.add_typer(trigger_app, name="trigger")

RUN_OVER = {"succeeded", "failed", "cancelled"}


def _client(ctx: typer.Context) -> DagClient:
    c = ctx_of(ctx)
    return DagClient(c.settings.dag_url, c.settings.bearer())


@app.command("submit")
def submit(ctx: typer.Context, file: Path, as_json: JsonFlag = False) -> None:
    """Store a workflow definition from a YAML or JSON file (a new version when it
    changed)."""
    definition: WorkflowCreate = validated(WorkflowCreate, load_document(file), str(file))

    async def go() -> tuple[Workflow, bool]:
        async with _client(ctx) as dag:
            return await dag.put_workflow(definition)

    workflow, created = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(workflow)
    else:
        change = "stored" if created else "unchanged"
        output.console.print(
            f"workflow [bold]{output.safe(workflow.name)}[/bold] version {workflow.version} {change} "
            f"({len(workflow.definition.nodes)} nodes)"
        )


@app.command("apply")
def apply(
    ctx: typer.Context,
    file: Path,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print the definitions as JSON, send nothing")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Store the workflows a Python file makes with ``cairn.sdk`` (docs/sdk.md): each a
    new version when its definition changed. Every one is checked before any is sent."""
    try:
        workflows = sdk.load_file(file)
        definitions = sdk.render_all(workflows)
    except sdk.DefinitionError as exc:
        output.errors.print(f"[red]error[/red] {output.safe(file)}: {output.safe(exc.detail)}")
        raise typer.Exit(2) from None
    if dry_run:
        output.dump([d.model_dump(mode="json", exclude_unset=True) for d in definitions])
        return

    async def go() -> list[sdk.Applied]:
        async with _client(ctx) as dag:
            return await sdk.apply(dag, workflows)

    applied = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump([a.stored for a in applied])
        return
    for one in applied:
        change = "stored" if one.created else "unchanged"
        output.console.print(
            f"workflow [bold]{output.safe(one.name)}[/bold] version {one.version} {change} "
            f"({len(one.stored.definition.nodes)} nodes)"
        )


@app.command("ls")
def list_workflows(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Workflows, newest version of each."""

    async def go() -> Any:
        async with _client(ctx) as dag:
            return await dag.list_workflows()

    found = output.call(go).items
    if ctx_of(ctx).json or as_json:
        output.dump(found)
    else:
        output.table(
            None,
            ["name", "version", "nodes", "owner", "created"],
            [[w.name, w.version, w.nodes, w.owner, output.ago(w.created_at)] for w in found],
        )


@app.command("run")
def run(
    ctx: typer.Context,
    workflow: str,
    param: Annotated[list[str] | None, typer.Option(help="parameter KEY=VALUE")] = None,
    key: Annotated[str | None, typer.Option(help="idempotency key")] = None,
    wait: Annotated[bool, typer.Option(help="follow the run until it ends")] = False,
    timeout: Annotated[
        int | None, typer.Option(help="fail the run after this many seconds", min=1)
    ] = None,
    task_timeout: Annotated[
        int | None,
        typer.Option(help="timeout_s of its node tasks that set none (over the workflow's)", min=1),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Start a run of a workflow."""
    params = output.pairs(param or [])

    async def go() -> tuple[Run, bool]:
        async with _client(ctx) as dag:
            return await dag.start_run(
                workflow,
                params,
                idempotency_key=key,
                timeout_s=timeout,
                task_timeout_s=task_timeout,
            )

    started, _ = output.call(go)
    if wait:
        started = follow(ctx, started.id)
    if ctx_of(ctx).json or as_json:
        output.dump(started)
    else:
        output.console.print(f"run [bold]{started.id}[/bold] {output.state(started.state)}")
    if wait and started.state != "succeeded":
        raise typer.Exit(1)


def _gate(node: Node) -> str:
    """An approval gate's wait or decision (or an event node's wait), for the tree."""
    if node.state == NodeState.WAITING and node.event is not None:
        return f" [yellow]waits for event {output.safe(node.event)}[/yellow]"
    if node.state == NodeState.WAITING and node.decision is None:
        return " [yellow]waits for approval[/yellow]"
    if node.decision is None:
        return ""
    by = output.safe(node.decided_by or "its timeout")
    said = f": {output.safe(node.comment)}" if node.comment and node.decided_by else ""
    return f" [dim]{node.decision}d by {by}{said}[/dim]"


def tree(found: Run) -> Tree:
    """The run as a tree: each node under its first upstream node, with its state."""
    origin = (
        f" [dim](sub-workflow of run {found.parent_run_id}, node "
        f"{output.safe(found.parent_node or '')})[/dim]"
        if found.parent_run_id
        else ""
    )
    root = Tree(
        f"run {found.id} [bold]{output.safe(found.workflow)}[/bold] v{found.workflow_version}: "
        f"{output.state(found.state)}{origin}"
    )
    branches: dict[str, Tree] = {}
    by_name = {n.name: n for n in found.nodes}
    placed: set[str] = set()

    def label(name: str) -> str:
        node = by_name[name]
        extra = f" task {node.task_id}" if node.task_id else ""
        extra += f" child run {node.child_run_id}" if node.child_run_id else ""
        if node.map_of is not None:
            extra += f" [dim]item {output.safe(json.dumps(node.map_item)[:60])}[/dim]"
        extra += f" try {node.try_number}" if node.try_number > 1 else ""
        also = node.depends_on[1:]
        if also:
            extra += f" [dim](also after {output.safe(', '.join(also))})[/dim]"
        extra += _gate(node)
        if node.error:  # a skip's reason (a false ``when``) is not an error
            style = "dim" if node.state == NodeState.SKIPPED else "red"
            extra += f" [{style}]{output.safe(node.error)}[/{style}]"
        return f"{output.safe(name)}: {output.state(node.state)}{extra}"

    pending = list(found.nodes)
    while pending:
        rest = []
        for node in pending:
            parent = node.map_of or (node.depends_on[0] if node.depends_on else None)
            if parent is None or parent in placed:
                holder = root if parent is None else branches[parent]
                branches[node.name] = holder.add(label(node.name))
                placed.add(node.name)
            else:
                rest.append(node)
        if len(rest) == len(pending):  # should not happen in a valid graph
            for node in rest:
                branches[node.name] = root.add(label(node.name))
            break
        pending = rest
    return root


def follow(ctx: typer.Context, run_id: int, timeout: float = 24 * 3600) -> Run:
    """Redraw the run's tree until it ends."""

    async def get() -> Run:
        async with _client(ctx) as dag:
            return await dag.get_run(run_id)

    deadline = time.monotonic() + timeout
    found = output.call(get)
    with Live(tree(found), console=output.errors, transient=False) as live:
        while found.state not in RUN_OVER and time.monotonic() < deadline:
            time.sleep(0.5)
            found = output.call(get)
            live.update(tree(found))
    return found


@app.command("status")
def status(
    ctx: typer.Context,
    run_id: int,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="redraw until it ends")] = False,
    as_json: JsonFlag = False,
) -> None:
    """A run with its nodes' states, as a tree."""
    if watch:
        found = follow(ctx, run_id)
        if ctx_of(ctx).json or as_json:
            output.dump(found)
        return

    async def go() -> Run:
        async with _client(ctx) as dag:
            return await dag.get_run(run_id)

    found = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(found)
    else:
        output.console.print(tree(found))
        if found.reason:
            output.console.print(f"[red]{output.safe(found.reason)}[/red]")


@app.command("outputs")
def outputs(
    ctx: typer.Context,
    run_id: int,
    node: Annotated[str | None, typer.Option(help="only this node (or NODE[INDEX])")] = None,
    as_json: JsonFlag = False,
) -> None:
    """What a run's nodes handed on: each output a node kept (a mapped node's as the
    list of its instances' values)."""

    async def go() -> Run:
        async with _client(ctx) as dag:
            return await dag.get_run(run_id)

    found = output.call(go)
    kept = {
        n.name: n.outputs
        for n in found.nodes
        if n.outputs is not None and (node is None or n.name == node)
    }
    if node is not None and node not in {n.name for n in found.nodes}:
        output.errors.print(f"run {run_id} has no node '{output.safe(node)}'")
        raise typer.Exit(1)
    if ctx_of(ctx).json or as_json:
        output.dump(kept)
        return
    rows = [
        [name, key, json.dumps(value) if not isinstance(value, str) else value]
        for name, values in kept.items()
        for key, value in values.items()
    ]
    output.table(None, ["node", "output", "value"], rows)


@app.command("clear")
def clear(
    ctx: typer.Context,
    run_id: int,
    node: str,
    only: Annotated[
        bool, typer.Option("--only", help="this node alone, not what is downstream of it")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Run a finished run again from NODE: it and everything downstream of it get their
    next try; the rest keep their outcomes and outputs."""

    async def go() -> Run:
        async with _client(ctx) as dag:
            return await dag.clear_run(run_id, node, downstream=not only)

    found = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(found)
    else:
        again = sorted(n.name for n in found.nodes if n.state == "pending")
        output.console.print(
            f"run {found.id} {output.state(found.state)}: again {output.safe(', '.join(again))}"
        )


def _on_run(name: str, method: str, doc: str) -> None:
    def command(ctx: typer.Context, run_id: int, as_json: JsonFlag = False) -> None:
        async def go() -> Run:
            async with _client(ctx) as dag:
                found: Run = await getattr(dag, method)(run_id)
                return found

        found = output.call(go)
        if ctx_of(ctx).json or as_json:
            output.dump(found)
        else:
            output.console.print(f"run {found.id} {output.state(found.state)}")

    command.__doc__ = doc
    app.command(name)(command)


_on_run("cancel", "cancel_run", "Cancel a run; its running node tasks are cancelled in core.")


def _decision(decision: Literal["approve", "reject"], doc: str) -> None:
    def command(
        ctx: typer.Context,
        run_id: int,
        node: str,
        comment: Annotated[str, typer.Option("--comment", "-m", help="why (kept with it)")] = "",
        as_json: JsonFlag = False,
    ) -> None:
        async def go() -> Run:
            async with _client(ctx) as dag:
                return await dag.decide(run_id, node, decision, comment)

        found = output.call(go)
        if ctx_of(ctx).json or as_json:
            output.dump(found)
        else:
            output.console.print(f"run {found.id}: {output.safe(node)} {decision}d")

    command.__doc__ = doc
    app.command(decision)(command)


_decision("approve", "Approve RUN's waiting approval gate NODE: it succeeds, what is below runs.")
_decision("reject", "Reject RUN's waiting approval gate NODE: it fails, trigger rules decide.")


@app.command("retry")
def retry(
    ctx: typer.Context,
    run_id: int,
    failed_instances: Annotated[
        bool,
        typer.Option(
            "--failed-instances",
            help="a failed mapped node keeps the instances that succeeded, runs the rest again",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Run a failed or cancelled run again from the nodes that did not succeed."""

    async def go() -> Run:
        async with _client(ctx) as dag:
            return await dag.retry_run(run_id, failed_instances=failed_instances)

    found = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(found)
    else:
        again = sorted(n.name for n in found.nodes if n.state in ("pending", "ready"))
        output.console.print(
            f"run {found.id} {output.state(found.state)}: "
            f"again {output.safe(', '.join(again) or '-')}"
        )


@app.command("graph")
def graph(
    ctx: typer.Context,
    run_id: int,
    mermaid: Annotated[bool, typer.Option(help="print Mermaid text")] = False,
) -> None:
    """A run's graph: JSON nodes and edges, or Mermaid text."""

    async def go() -> Any:
        async with _client(ctx) as dag:
            return await (dag.mermaid(run_id) if mermaid else dag.graph(run_id))

    found = output.call(go)
    if mermaid:
        output.console.out(output.visible(found), highlight=False)
    else:
        output.dump(found)


@app.command("signal")
def signal(
    ctx: typer.Context,
    run_id: int,
    event: str,
    data: Annotated[
        str | None, typer.Option(help="the event's data: a JSON object (the node's outputs)")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Deliver EVENT to RUN: the node waiting for it succeeds with the data as its
    outputs (one that waits later finds it; an event is kept once per run)."""
    try:
        parsed = json.loads(data) if data is not None else {}
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--data is not JSON: {exc}") from None
    body: EventDelivery = validated(EventDelivery, {"data": parsed}, "--data")

    async def go() -> RunEvent:
        async with _client(ctx) as dag:
            return await dag.send_event(run_id, event, body.data)

    found = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(found)
    else:
        to = f"node {output.safe(found.node)}" if found.node else "kept until a node waits"
        output.console.print(f"run {found.run_id}: event {output.safe(found.name)} -> {to}")


@trigger_app.command("create")
def trigger_create(
    ctx: typer.Context,
    workflow: str,
    param: Annotated[
        list[str] | None,
        typer.Option(help="run parameter NAME=PATH, PATH dotted into the payload (a.b.c)"),
    ] = None,
    key_path: Annotated[
        str | None, typer.Option(help="the payload's idempotency key, dotted (order.id)")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a signed trigger of WORKFLOW; its secret is shown this once."""
    mapping = output.pairs(param) if param else None
    body: TriggerCreate = validated(
        TriggerCreate, {"params": mapping, "key_path": key_path}, "the trigger"
    )

    async def go() -> TriggerCreated:
        async with _client(ctx) as dag:
            return await dag.create_trigger(workflow, body)

    made = output.call(go)
    if ctx_of(ctx).json or as_json:
        output.dump(made)
        return
    output.console.print(f"trigger [bold]{made.id}[/bold]: POST {output.safe(made.path)}")
    output.console.print(f"secret (shown once, keep it): {output.safe(made.secret)}")


@trigger_app.command("list")
def trigger_list(ctx: typer.Context, workflow: str, as_json: JsonFlag = False) -> None:
    """WORKFLOW's triggers (never their secrets)."""

    async def go() -> Any:
        async with _client(ctx) as dag:
            return await dag.list_triggers(workflow)

    found = output.call(go).items
    if ctx_of(ctx).json or as_json:
        output.dump(found)
        return
    output.table(
        None,
        ["id", "path", "params", "key path", "created"],
        [
            [t.id, t.path, json.dumps(t.params) if t.params else "payload's params",
             t.key_path or "-", output.ago(t.created_at)]
            for t in found
        ],
    )  # fmt: skip


@trigger_app.command("delete")
def trigger_delete(ctx: typer.Context, workflow: str, trigger_id: int) -> None:
    """Delete WORKFLOW's trigger TRIGGER_ID: its deliveries are refused from now on."""

    async def go() -> None:
        async with _client(ctx) as dag:
            await dag.delete_trigger(workflow, trigger_id)

    output.call(go)
    output.console.print(f"trigger {trigger_id} deleted")
