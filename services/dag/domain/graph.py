"""A workflow definition checked and ordered: no cycle, no unknown or duplicate node,
templates that name only what exists. Ordering is networkx's topological sort."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

from libs.common.dag_models import NodeSpec, TriggerRule, WorkflowCreate
from libs.common.errors import InvalidInput

# {{ params.x }}, {{ run.id }}, {{ node.try }}, {{ nodes.extract.output_path }},
# {{ fire.slot }} (empty unless a cron fire started the run)
TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_REFERENCE = re.compile(
    r"^(?:params\.(?P<param>[A-Za-z_][A-Za-z0-9_]*)"
    r"|run\.(?:id|workflow|owner)"
    r"|node\.(?:name|try)"
    r"|fire\.(?:slot|schedule_id|backfill)"
    r"|nodes\.(?P<node>[A-Za-z0-9_][A-Za-z0-9_.\-]*)\.output_path)$"
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

    def rule(self, name: str) -> TriggerRule:
        return self.specs[name].trigger_rule


def _templated_fields(spec: NodeSpec) -> list[tuple[str, str]]:
    task = spec.task
    fields = [(f"task.args.{i}", arg) for i, arg in enumerate(task.args)]
    fields += [
        (f"task.env.{key}", value) for key, value in task.env.items() if isinstance(value, str)
    ]
    fields += [(f"task.{name}", getattr(task, name)) for name in ("input_path", "output_path")]
    return [(where, text) for where, text in fields if text and "{{" in text]


def _references(
    index: int, spec: NodeSpec, errors: list[dict[str, str]]
) -> tuple[set[str], set[str]]:
    """The parameters and upstream outputs one node's templates name."""
    params: set[str] = set()
    outputs: set[str] = set()
    for where, text in _templated_fields(spec):
        for expression in TEMPLATE.findall(text):
            match = _REFERENCE.match(expression)
            field_name = f"body.nodes.{index}.{where}"
            if match is None:
                errors.append(
                    {"field": field_name, "reason": f"unknown template {{{{ {expression} }}}}"}
                )
            elif match["param"]:
                params.add(match["param"])
            elif match["node"]:
                if where == "task.output_path":
                    errors.append(
                        {
                            "field": field_name,
                            "reason": "an output path may not name another node's",
                        }
                    )
                outputs.add(match["node"])
    return params, outputs


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
    for i, node in enumerate(definition.nodes):
        used, outputs = _references(i, node, errors)
        params |= used
        if outputs:
            ancestors = nx.ancestors(graph, node.name)
            for name in sorted(outputs):
                if name not in ancestors:
                    errors.append(
                        {
                            "field": f"body.nodes.{i}.task",
                            "reason": f"'{name}' is not upstream of '{node.name}'",
                        }
                    )
                elif specs[name].task.output_path is None:
                    errors.append(
                        {"field": f"body.nodes.{i}.task", "reason": f"'{name}' has no output_path"}
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
    )
