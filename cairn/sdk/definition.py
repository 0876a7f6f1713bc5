"""Workflows and nodes in Python, rendered to the DAG service's definition
(``libs.common.dag_models.WorkflowCreate``) and checked by the service's own rules
(``services.dag.domain.graph.build``) before anything is sent."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Literal, overload

from pydantic import TypeAdapter, ValidationError

from cairn.sdk.refs import Ref
from libs.common.dag_models import (
    MapSpec,
    NodeSpec,
    OutputSpec,
    ParamValue,
    TriggerRule,
    WorkflowCreate,
    WorkflowName,
)
from libs.common.errors import InvalidInput
from libs.common.models import (
    Artifact,
    Concurrency,
    Placement,
    Resources,
    RetryPolicy,
    SecretRef,
    ServiceSpec,
)


class DefinitionError(InvalidInput):
    """The workflow is not one the DAG service would take. ``extra["errors"]`` lists
    each problem with the service's ``field``, the ``node`` it is in and the ``reason``."""


# The workflows whose ``with`` block is open (innermost last), and the workflows made
# while a file is being loaded (``collecting``).
_open: ContextVar[tuple[Workflow, ...]] = ContextVar("cairn_sdk_open", default=())
_made: ContextVar[list[Workflow] | None] = ContextVar("cairn_sdk_made", default=None)


@contextmanager
def collecting() -> Iterator[list[Workflow]]:
    """Every ``Workflow`` made inside the block, in order."""
    made: list[Workflow] = []
    token = _made.set(made)
    try:
        yield made
    finally:
        _made.reset(token)


def _validation_reasons(exc: ValidationError) -> list[tuple[tuple[str | int, ...], str]]:
    return [(tuple(err["loc"]), err["msg"]) for err in exc.errors()]


def _dotted(loc: Iterable[str | int]) -> str:
    return ".".join(str(part) for part in loc)


class _Outputs:
    """``node.outputs.NAME`` (or ``node.outputs["NAME"]``): a reference to a declared
    output, ``{{ nodes.NODE.outputs.NAME }}``."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def __getitem__(self, name: str) -> Ref:
        if name not in self._node.spec.outputs:
            declared = ", ".join(self._node.spec.outputs) or "none"
            raise DefinitionError(
                f"node {self._node.name!r} declares no output {name!r} (it declares: {declared})"
            )
        return Ref(f"nodes.{self._node.name}.outputs.{name}")

    def __getattr__(self, name: str) -> Ref:
        if name.startswith("_"):
            raise AttributeError(name)  # copy and pickle probe these; use outputs["_x"]
        return self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._node.spec.outputs)


class Node:
    """One node: its task (a submission to core, every field of ``TaskCreate`` but the
    ones the service sets), what it waits for and when it may run. Checked when made: a
    bad field raises ``DefinitionError`` naming the node.

    Inside ``with Workflow(...)`` a node joins that workflow. ``a >> b`` (or ``b << a``)
    makes ``b`` depend on ``a``; either side may be a list. ``extra`` holds node fields
    the service takes that this SDK has no keyword for yet, as the JSON has them."""

    def __init__(
        self,
        name: str,
        *,
        artifact: Artifact,
        args: Sequence[str] | None = None,
        env: Mapping[str, str | SecretRef] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        kind: Literal["task", "service"] | None = None,
        input_path: str | None = None,
        output_path: str | None = None,
        resources: Resources | None = None,
        preemptible: bool | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: int | None = None,
        max_wait_s: int | None = None,
        labels: Mapping[str, str] | None = None,
        defer_ok: bool | None = None,
        deadline: datetime | None = None,
        team: str | None = None,
        concurrency: Concurrency | None = None,
        progress_timeout_s: int | None = None,
        placement: Placement | Mapping[str, Any] | None = None,
        service: ServiceSpec | Mapping[str, Any] | None = None,
        task_name: str | None = None,
        depends_on: Iterable[Node] = (),
        trigger_rule: TriggerRule | str | None = None,
        outputs: Sequence[str] | Mapping[str, OutputSpec] | None = None,
        map: str | MapSpec | None = None,
        workflow: Workflow | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        task: dict[str, Any] = {
            "name": task_name,
            "artifact": artifact,
            "args": list(args) if args is not None else None,
            "env": dict(env) if env is not None else None,
            "queue": queue,
            "priority": priority,
            "kind": kind,
            "input_path": input_path,
            "output_path": output_path,
            "resources": resources,
            "preemptible": preemptible,
            "retry": retry,
            "timeout_s": timeout_s,
            "max_wait_s": max_wait_s,
            "labels": dict(labels) if labels is not None else None,
            "defer_ok": defer_ok,
            "deadline": deadline,
            "team": team,
            "concurrency": concurrency,
            "progress_timeout_s": progress_timeout_s,
            "placement": placement,
            "service": service,
        }
        fields: dict[str, Any] = {
            "name": name,
            "task": {key: value for key, value in task.items() if value is not None},
            "trigger_rule": trigger_rule,
            "outputs": _declared(outputs),
            "map": {"over": map} if isinstance(map, str) else map,
            **_extra(extra, {"name", "task", "depends_on"}, f"node {name!r}"),
        }
        self._join(fields, task_name is not None, workflow, depends_on)

    def _join(
        self,
        fields: dict[str, Any],
        named_task: bool,
        workflow: Workflow | None,
        depends_on: Iterable[Node],
    ) -> None:
        """Check the node's fields, then join its workflow and its upstream nodes."""
        self.spec: NodeSpec = _checked_node({k: v for k, v in fields.items() if v is not None})
        self.name: str = self.spec.name
        self._named_task = named_task
        self._upstream: dict[int, Node] = {}
        self._downstream: dict[int, Node] = {}
        self.workflow: Workflow | None = None
        self.outputs = _Outputs(self)
        into = workflow if workflow is not None else (_open.get() or (None,))[-1]
        if into is not None:
            into.add(self)
        for up in depends_on:
            up >> self

    def __repr__(self) -> str:
        return f"Node({self.name!r})"

    @property
    def output_path(self) -> Ref:
        """``{{ nodes.NODE.output_path }}``: this node's rendered ``output_path``."""
        if self.spec.task is None or self.spec.task.output_path is None:
            raise DefinitionError(f"node {self.name!r} has no output_path")
        if self.spec.map is not None:
            raise DefinitionError(f"node {self.name!r} is mapped: name one of its outputs")
        return Ref(f"nodes.{self.name}.output_path")

    @property
    def upstream(self) -> tuple[Node, ...]:
        """The nodes this one depends on, in the order they were added."""
        return tuple(self._upstream.values())

    @property
    def downstream(self) -> tuple[Node, ...]:
        return tuple(self._downstream.values())

    def set_upstream(self, *nodes: Node) -> None:
        """Make this node depend on ``nodes`` (``nodes >> self``)."""
        for up in nodes:
            _link(up, self)

    @overload
    def __rshift__(self, other: Node) -> Node: ...
    @overload
    def __rshift__(self, other: Sequence[Node]) -> Sequence[Node]: ...
    def __rshift__(self, other: Node | Sequence[Node]) -> Node | Sequence[Node]:
        for down in _nodes(other):
            _link(self, down)
        return other

    def __rrshift__(self, other: Sequence[Node]) -> Node:
        for up in _nodes(other):
            _link(up, self)
        return self

    @overload
    def __lshift__(self, other: Node) -> Node: ...
    @overload
    def __lshift__(self, other: Sequence[Node]) -> Sequence[Node]: ...
    def __lshift__(self, other: Node | Sequence[Node]) -> Node | Sequence[Node]:
        for up in _nodes(other):
            _link(up, self)
        return other

    def __rlshift__(self, other: Sequence[Node]) -> Node:
        for down in _nodes(other):
            _link(self, down)
        return self

    def render(self) -> dict[str, Any]:
        """This node as the definition's JSON holds it: the fields that were given."""
        body = self.spec.model_dump(mode="json", exclude_unset=True)
        if not self._named_task and "task" in body:
            del body["task"]["name"]  # the service names the task after the node
        if self._upstream:
            body["depends_on"] = [up.name for up in self._upstream.values()]
        return body


class Approval(Node):
    """An approval gate: when its rule is met it waits for a person to approve (it
    succeeds) or reject (it fails) it; after ``timeout_s`` without a decision
    ``on_timeout`` decides. ``people`` and ``team`` name who may decide (neither: the
    run's owner and its team). Joins workflows and links like any ``Node``."""

    def __init__(
        self,
        name: str,
        *,
        timeout_s: int,
        on_timeout: Literal["approve", "reject"],
        people: Sequence[str] = (),
        team: str | None = None,
        depends_on: Iterable[Node] = (),
        trigger_rule: TriggerRule | str | None = None,
        when: str | None = None,
        workflow: Workflow | None = None,
    ) -> None:
        approvers = {"people": list(people), "team": team} if people or team else None
        approval: dict[str, Any] = {"timeout_s": timeout_s, "on_timeout": on_timeout}
        if approvers is not None:
            approval["approvers"] = {k: v for k, v in approvers.items() if v}
        fields = {"name": name, "approval": approval, "trigger_rule": trigger_rule, "when": when}
        self._join(fields, False, workflow, depends_on)


class SubWorkflow(Node):
    """Runs another stored workflow (``child``: its name, or the ``Workflow``) of the
    same owner as a child run: ``version`` pins one (default: its newest when the run
    starts). ``params`` are the child's, values may be templates (``param("day")``,
    ``other.outputs.rows``). The node ends as the child run does and keeps as
    ``outputs`` the values of those names its child's nodes kept."""

    def __init__(
        self,
        name: str,
        child: str | Workflow,
        *,
        version: int | None = None,
        params: Mapping[str, ParamValue] | None = None,
        outputs: Sequence[str] | None = None,
        depends_on: Iterable[Node] = (),
        trigger_rule: TriggerRule | str | None = None,
        when: str | None = None,
        workflow: Workflow | None = None,
    ) -> None:
        spec: dict[str, Any] = {"name": child if isinstance(child, str) else child.name}
        if version is not None:
            spec["version"] = version
        if params:
            spec["params"] = dict(params)
        fields = {
            "name": name,
            "workflow": spec,
            "outputs": _declared(outputs),
            "trigger_rule": trigger_rule,
            "when": when,
        }
        self._join(fields, False, workflow, depends_on)


class WaitForEvent(Node):
    """A node that waits for the external event ``event`` instead of running a task
    (docs/dag.md, "Events"): delivered to its run (``cairn dag signal RUN EVENT``), it
    succeeds with the event's data as its ``outputs``; after ``timeout_s`` without it,
    ``on_timeout`` decides (``fail`` or ``succeed``)."""

    def __init__(
        self,
        name: str,
        *,
        event: str,
        timeout_s: int,
        on_timeout: Literal["succeed", "fail"] = "fail",
        depends_on: Iterable[Node] = (),
        trigger_rule: TriggerRule | str | None = None,
        outputs: Sequence[str] | Mapping[str, OutputSpec] | None = None,
        workflow: Workflow | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        fields: dict[str, Any] = {
            "name": name,
            "event": {"name": event, "timeout_s": timeout_s, "on_timeout": on_timeout},
            "trigger_rule": trigger_rule,
            "outputs": _declared(outputs),
            **_extra(extra, {"name", "task", "event", "depends_on"}, f"node {name!r}"),
        }
        self._join(fields, False, workflow, depends_on)

    def __repr__(self) -> str:
        return f"WaitForEvent({self.name!r})"


def _extra(extra: Mapping[str, Any] | None, reserved: set[str], what: str) -> dict[str, Any]:
    """Fields of the definition this SDK has no keyword for yet, as its JSON has them
    (checked all the same)."""
    taken = sorted(reserved & set(extra or {}))
    if taken:
        raise DefinitionError(f"{what}: extra may not set {', '.join(taken)}")
    return dict(extra or {})


def _declared(outputs: Sequence[str] | Mapping[str, OutputSpec] | None) -> Any:
    if outputs is None:
        return None
    if isinstance(outputs, Mapping):
        return dict(outputs)
    if isinstance(outputs, str):
        return {outputs: OutputSpec()}
    return {name: OutputSpec() for name in outputs}


def _checked_node(fields: dict[str, Any]) -> NodeSpec:
    name = fields["name"]
    try:
        return NodeSpec.model_validate(fields)
    except ValidationError as exc:
        errors = [
            {"field": _dotted(loc), "node": name, "reason": msg}
            for loc, msg in _validation_reasons(exc)
        ]
        first = errors[0]
        raise DefinitionError(
            f"node {name!r}: {first['field']}: {first['reason']}", errors=errors
        ) from None


def _nodes(value: object) -> list[Node]:
    items = [value] if isinstance(value, Node) else value
    if not isinstance(items, Sequence) or not all(isinstance(n, Node) for n in items):
        raise TypeError(f"a dependency is between nodes, not {type(value).__name__}")
    return list(items)


def _link(up: Node, down: Node) -> None:
    """``down`` depends on ``up``; a node of no workflow joins the other's."""
    if up.workflow is None and down.workflow is not None:
        down.workflow.add(up)
    elif down.workflow is None and up.workflow is not None:
        up.workflow.add(down)
    elif up.workflow is not down.workflow:
        raise DefinitionError(
            f"node {down.name!r} of workflow {_name(down.workflow)} cannot depend on node "
            f"{up.name!r} of workflow {_name(up.workflow)}"
        )
    down._upstream[id(up)] = up
    up._downstream[id(down)] = down


def _name(workflow: Workflow | None) -> str:
    return repr(workflow.name) if workflow is not None else "(none)"


def chain(*steps: Node | Sequence[Node]) -> None:
    """Each step depends on the one before: ``chain(a, [b, c], d)`` is
    ``a >> [b, c] >> d`` (every node of a list on every node of the step before)."""
    for before, after in itertools.pairwise(steps):
        for up in _nodes(before):
            for down in _nodes(after):
                _link(up, down)


_WORKFLOW_NAME: TypeAdapter[str] = TypeAdapter(WorkflowName)
_FIELD = re.compile(r"^body\.nodes\.(\d+)(?:\.(.*))?$")


class Workflow:
    """A workflow: its nodes and the definition's options (``WorkflowCreate``'s fields).
    ``render()`` gives the definition the DAG service takes, or raises
    ``DefinitionError`` naming the node and the field. ``extra``: top-level fields this
    SDK has no keyword for yet."""

    def __init__(
        self,
        name: str,
        *,
        description: str | None = None,
        params: Mapping[str, ParamValue] | None = None,
        team: str | None = None,
        max_active_runs: int | None = None,
        timeout_s: int | None = None,
        max_active_nodes: int | None = None,
        task_timeout_s: int | None = None,
        nodes: Iterable[Node] = (),
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            self.name: str = _WORKFLOW_NAME.validate_python(name)
        except ValidationError:
            raise DefinitionError(
                f"{name!r} is not a workflow name (lower-case letters, digits, _ . -)"
            ) from None
        self.options: dict[str, Any] = {
            key: value
            for key, value in {
                "team": team,
                "description": description,
                "params": dict(params) if params is not None else None,
                "max_active_runs": max_active_runs,
                "timeout_s": timeout_s,
                "max_active_nodes": max_active_nodes,
                "task_timeout_s": task_timeout_s,
            }.items()
            if value is not None
        } | _extra(extra, {"name", "nodes"}, f"workflow {name!r}")
        self._nodes: dict[str, Node] = {}
        self._tokens: list[Any] = []
        self.add(*nodes)
        made = _made.get()
        if made is not None:
            made.append(self)

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, {len(self._nodes)} nodes)"

    def __enter__(self) -> Workflow:
        self._tokens.append(_open.set((*_open.get(), self)))
        return self

    def __exit__(self, *_: object) -> None:
        _open.reset(self._tokens.pop())

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes in the order they were added."""
        return tuple(self._nodes.values())

    def __getitem__(self, name: str) -> Node:
        return self._nodes[name]

    def add(self, *nodes: Node) -> None:
        """Make ``nodes`` part of this workflow (a node made inside ``with`` already is)."""
        for node in nodes:
            if node.workflow is self:
                continue
            if node.workflow is not None:
                raise DefinitionError(
                    f"node {node.name!r} is already in workflow {node.workflow.name!r}"
                )
            if node.name in self._nodes:
                raise DefinitionError(
                    f"workflow {self.name!r} already has a node named {node.name!r}"
                )
            self._nodes[node.name] = node
            node.workflow = self

    def render(self) -> WorkflowCreate:
        """The definition, checked as the DAG service checks it (fields and bounds, then
        the graph: no cycle, templates that name upstream nodes' declared outputs)."""
        self._check_neighbours()
        body = {**self.options, "name": self.name, "nodes": [n.render() for n in self.nodes]}
        try:
            definition = WorkflowCreate.model_validate(body)
        except ValidationError as exc:
            raise self._refusal(
                [(_dotted(("body", *loc)), msg) for loc, msg in _validation_reasons(exc)]
            ) from None
        # here, not at the top: networkx costs every CLI command a fifth of a second
        from services.dag.domain import graph

        try:
            graph.build(definition)
        except InvalidInput as exc:
            raise self._from_service(exc) from None
        return definition

    def to_dict(self) -> dict[str, Any]:
        """The definition as JSON data: exactly what ``POST /v1/workflows`` is sent."""
        return self.render().model_dump(mode="json", exclude_unset=True)

    def to_json(self, indent: int | None = 2) -> str:
        return self.render().model_dump_json(exclude_unset=True, indent=indent)

    def _check_neighbours(self) -> None:
        for node in self.nodes:
            for up in node.upstream:
                if self._nodes.get(up.name) is not up:
                    raise DefinitionError(
                        f"workflow {self.name!r}: node {node.name!r} depends on {up.name!r}, "
                        "which is not one of its nodes",
                        errors=[{"node": node.name, "reason": f"unknown node {up.name!r}"}],
                    )
            for down in node.downstream:
                if self._nodes.get(down.name) is not down:
                    raise DefinitionError(
                        f"workflow {self.name!r}: node {down.name!r} depends on {node.name!r} "
                        "but is not one of its nodes",
                        errors=[{"node": down.name, "reason": "not in the workflow"}],
                    )
        if not self._nodes:
            raise DefinitionError(f"workflow {self.name!r} has no nodes")

    def _refusal(self, problems: list[tuple[str, str]], **extra: Any) -> DefinitionError:
        errors = []
        for field, reason in problems:
            node, within = self._where(field)
            errors.append({"field": field, "node": node, "reason": reason})
        node, within = self._where(problems[0][0])
        where = (f"node {node!r}: " if node is not None else "") + (f"{within}: " if within else "")
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return DefinitionError(
            f"workflow {self.name!r}: {where}{problems[0][1]}{more}", errors=errors, **extra
        )

    def _where(self, field: str) -> tuple[str | None, str]:
        """The node a service field (``body.nodes.3.task.args.0``) is in, and the field
        within it (``task.args.0``)."""
        found = _FIELD.match(field)
        if found is None:
            return None, field.removeprefix("body").removeprefix(".")
        index = int(found[1])
        names = list(self._nodes)
        return (names[index] if index < len(names) else None), found[2] or ""

    def _from_service(self, exc: InvalidInput) -> DefinitionError:
        cycle = exc.extra.get("cycle")
        if cycle:
            return DefinitionError(
                f"workflow {self.name!r}: the nodes form a cycle: {' -> '.join(cycle)}",
                errors=[{"field": "body.nodes", "node": cycle[0], "reason": "cycle"}],
                cycle=cycle,
            )
        problems = [(e["field"], e["reason"]) for e in exc.extra.get("errors", [])]
        return self._refusal(problems or [("body", exc.detail)])


def render_all(workflows: Sequence[Workflow]) -> list[WorkflowCreate]:
    """Every workflow's definition, or the first refusal; two of one name are refused."""
    seen: set[str] = set()
    for workflow in workflows:
        if workflow.name in seen:
            raise DefinitionError(f"two workflows are named {workflow.name!r}")
        seen.add(workflow.name)
    return [workflow.render() for workflow in workflows]
