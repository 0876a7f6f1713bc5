"""A workflow definition checked and ordered: no cycle, no unknown or duplicate node,
templates that name only what exists. Ordering is networkx's topological sort."""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

from libs.common.dag_models import MAX_RUN_INSTANCES, NodeSpec, TriggerRule, WorkflowCreate
from libs.common.errors import InvalidInput
from services.dag.domain.conditions import Condition, ConditionError, parse_condition

# {{ params.x }}, {{ run.id }}, {{ node.try }}, {{ nodes.extract.output_path }},
# {{ nodes.extract.outputs.rows }}, {{ map.item }}, {{ map.index }},
# {{ fire.slot }} (empty unless a cron fire started the run)
TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_REFERENCE = re.compile(
    r"^(?:params\.(?P<param>[A-Za-z_][A-Za-z0-9_]*)"
    r"|run\.(?:id|workflow|owner)"
    r"|node\.(?:name|try)"
    r"|fire\.(?:slot|schedule_id|backfill)"
    r"|(?P<map>map)\.(?:item|index)"
    r"|nodes\.(?P<node>[A-Za-z0-9_][A-Za-z0-9_.\-]*)"
    r"\.(?:output_path|outputs\.(?P<output>[A-Za-z_][A-Za-z0-9_]*)))$"
)


@dataclass(frozen=True)
class Dag:
    """A valid definition: nodes in topological order with their neighbours."""

    definition: WorkflowCreate
    order: tuple[str, ...]
    specs: dict[str, NodeSpec]
    upstream: dict[str, tuple[str, ...]]
    downstream: dict[str, tuple[str, ...]]
    #: parameters some node refers to
    referenced_params: frozenset[str]
    leaves: frozenset[str] = field(default_factory=frozenset)
    #: the parsed ``when`` of each node that has one
    conditions: dict[str, Condition] = field(default_factory=dict)
    #: some node declares outputs (else no node of a run keeps any)
    keeps_outputs: bool = True

    def rule(self, name: str) -> TriggerRule:
        return self.specs[name].trigger_rule

    @functools.cached_property
    def settles_locally(self) -> bool:
        """Whether what a node's end changes is decided by its dependents' rules alone:
        no node maps (instances end their mapped node) and none has a condition (which may
        read a node above its own upstream nodes, and wait on it)."""
        return not self.conditions and all(spec.map is None for spec in self.specs.values())


def _templated_fields(spec: NodeSpec) -> list[tuple[str, str]]:
    task = spec.task
    fields: list[tuple[str, str | None]] = []
    if task is not None:  # an approval gate has no task
        fields += [(f"task.args.{i}", arg) for i, arg in enumerate(task.args)]
        fields += [
            (f"task.env.{key}", value) for key, value in task.env.items() if isinstance(value, str)
        ]
        fields += [(f"task.{name}", getattr(task, name)) for name in ("input_path", "output_path")]
    if spec.workflow is not None:
        fields += [
            (f"workflow.params.{key}", value)
            for key, value in spec.workflow.params.items()
            if isinstance(value, str)
        ]
    fields += [(f"outputs.{name}.path", out.path) for name, out in spec.outputs.items()]
    if spec.map is not None:
        fields.append(("map.over", spec.map.over))
    return [(where, text) for where, text in fields if text is not None and "{{" in text]


# Fields whose value must be known when the node is released, before anything upstream
# of it could be read again: they may not name another node's.
_OWN_ONLY = re.compile(r"^(?:task\.output_path|outputs\.[A-Za-z0-9_]+\.path)$")


@dataclass
class _Refs:
    params: set[str] = field(default_factory=set)
    #: (field, upstream node, output name or None for its output_path)
    nodes: list[tuple[str, str, str | None]] = field(default_factory=list)


def _references(index: int, spec: NodeSpec, errors: list[dict[str, str]]) -> _Refs:
    """The parameters and upstream outputs one node's templates name."""
    refs = _Refs()
    for where, text in _templated_fields(spec):
        field_name = f"body.nodes.{index}.{where}"
        for expression in TEMPLATE.findall(text):
            match = _REFERENCE.match(expression)
            if match is None:
                errors.append(
                    {"field": field_name, "reason": f"unknown template {{{{ {expression} }}}}"}
                )
            elif match["param"]:
                refs.params.add(match["param"])
            elif match["map"] and (spec.map is None or where == "map.over"):
                errors.append({"field": field_name, "reason": "map.item and map.index need a map"})
            elif match["node"]:
                if _OWN_ONLY.match(where):
                    errors.append(
                        {
                            "field": field_name,
                            "reason": "an output path may not name another node's",
                        }
                    )
                refs.nodes.append((field_name, match["node"], match["output"]))
    if spec.map is not None:
        over = _REFERENCE.match(TEMPLATE.findall(spec.map.over)[0])
        if over is not None and not (over["param"] or over["output"]):
            errors.append(
                {
                    "field": f"body.nodes.{index}.map.over",
                    "reason": "maps over {{ params.NAME }} or {{ nodes.NODE.outputs.NAME }}",
                }
            )
    return refs


def _condition(
    index: int, spec: NodeSpec, refs: _Refs, errors: list[dict[str, str]]
) -> Condition | None:
    """The node's ``when`` parsed, what it reads added to ``refs``."""
    if spec.when is None:
        return None
    where = f"body.nodes.{index}.when"
    try:
        parsed = parse_condition(spec.when)
    except ConditionError as exc:
        errors.append({"field": where, "reason": str(exc)})
        return None
    refs.params |= parsed.params
    refs.nodes += [(where, node, output) for node, output in sorted(parsed.outputs)]
    return parsed


def _output_path(spec: NodeSpec) -> str | None:
    return None if spec.task is None else spec.task.output_path


def _check_upstream(
    graph: nx.DiGraph, specs: dict[str, NodeSpec], name: str, refs: _Refs
) -> list[dict[str, str]]:
    """Each node a template names is upstream of ``name`` and has what is named."""
    errors = []
    ancestors = nx.ancestors(graph, name) if refs.nodes else set()
    for where, upstream, output in refs.nodes:
        if upstream not in ancestors:
            reason = f"'{upstream}' is not upstream of '{name}'"
        elif output is None and _output_path(specs[upstream]) is None:
            reason = f"'{upstream}' has no output_path"
        elif output is None and specs[upstream].map is not None:
            reason = f"'{upstream}' is mapped: name one of its outputs"
        elif output is not None and output not in specs[upstream].outputs:
            reason = f"'{upstream}' declares no output '{output}'"
        else:
            continue
        errors.append({"field": where, "reason": reason})
    return errors


def _refuse(errors: list[dict[str, str]], **extra: object) -> None:
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidInput(
            f"{errors[0]['field']}: {errors[0]['reason']}{more}", errors=errors[:50], **extra
        )


def _check_names(definition: WorkflowCreate) -> None:
    counts = Counter(node.name for node in definition.nodes)
    duplicates = sorted(name for name, n in counts.items() if n > 1)
    if duplicates:
        raise InvalidInput(
            f"body.nodes: duplicate node names: {', '.join(duplicates[:20])}",
            errors=[
                {"field": "body.nodes", "reason": f"duplicate node '{name}'"}
                for name in duplicates[:50]
            ],
            duplicates=duplicates[:50],
        )
    errors = []
    unknown: set[str] = set()
    for i, node in enumerate(definition.nodes):
        for j, upstream in enumerate(node.depends_on):
            if upstream not in counts:
                unknown.add(upstream)
                errors.append(
                    {
                        "field": f"body.nodes.{i}.depends_on.{j}",
                        "reason": f"unknown node '{upstream}'",
                    }
                )
        if len(set(node.depends_on)) != len(node.depends_on):
            errors.append({"field": f"body.nodes.{i}.depends_on", "reason": "names a node twice"})
    _refuse(errors, unknown=sorted(unknown)[:50])


def _cycle(graph: nx.DiGraph) -> None:
    try:
        edges = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    path = [edges[0][0], *(target for _, target in edges)]
    raise InvalidInput(
        f"body.nodes: the nodes form a cycle: {' -> '.join(path)}",
        errors=[{"field": "body.nodes", "reason": f"cycle {' -> '.join(path)}"}],
        cycle=path,
    )


def build(definition: WorkflowCreate) -> Dag:
    """Check ``definition`` and order it; raise ``InvalidInput`` naming what is wrong."""
    _check_names(definition)
    graph: nx.DiGraph = nx.DiGraph()
    graph.add_nodes_from(node.name for node in definition.nodes)
    graph.add_edges_from((up, node.name) for node in definition.nodes for up in node.depends_on)
    try:
        order = tuple(nx.topological_sort(graph))
    except nx.NetworkXUnfeasible:
        _cycle(graph)
        raise
    specs = {node.name: node for node in definition.nodes}
    errors: list[dict[str, str]] = []
    params: set[str] = set()
    parsed: dict[str, Condition] = {}
    for i, node in enumerate(definition.nodes):
        refs = _references(i, node, errors)
        if (condition := _condition(i, node, refs, errors)) is not None:
            parsed[node.name] = condition
        params |= refs.params
        errors += _check_upstream(graph, specs, node.name, refs)
    mapped = sum(node.map.max_items for node in definition.nodes if node.map is not None)
    if mapped > MAX_RUN_INSTANCES:
        errors.append(
            {
                "field": "body.nodes",
                "reason": f"the maps' max_items add up to {mapped}, more than {MAX_RUN_INSTANCES}",
            }
        )
    _refuse(errors)
    return Dag(
        definition=definition,
        order=order,
        specs=specs,
        upstream={name: tuple(specs[name].depends_on) for name in order},
        downstream={name: tuple(graph.successors(name)) for name in order},
        referenced_params=frozenset(params),
        leaves=frozenset(name for name in order if graph.out_degree(name) == 0),
        conditions=parsed,
        keeps_outputs=any(spec.outputs for spec in specs.values()),
    )
