"""A run drawn as a Mermaid flowchart: one box per node, coloured by its state."""

from __future__ import annotations

from collections.abc import Sequence

from libs.common.dag_models import GraphEdge, Node, NodeState

_COLOURS = {
    NodeState.SUCCEEDED: "fill:#c8e6c9",
    NodeState.FAILED: "fill:#ffcdd2",
    NodeState.UPSTREAM_FAILED: "fill:#ffe0b2",
    NodeState.SKIPPED: "fill:#eeeeee",
    NodeState.RUNNING: "fill:#bbdefb",
    NodeState.RELEASED: "fill:#e3f2fd",
    NodeState.CANCELLED: "fill:#d7ccc8",
    NodeState.WAITING: "fill:#fff3c4",
}


def mermaid(nodes: Sequence[Node], edges: Sequence[GraphEdge]) -> str:
    """Node names can hold dots and dashes, so each box gets an id (n0, n1...) and shows
    the name and state as its label."""
    ids = {node.name: f"n{i}" for i, node in enumerate(nodes)}
    lines = ["flowchart TD"]
    lines += [f'    {ids[n.name]}["{n.name}<br/>{n.state}"]' for n in nodes]
    lines += [f"    {ids[e.source]} --> {ids[e.target]}" for e in edges]
    for state in sorted({n.state for n in nodes if n.state in _COLOURS}):
        lines.append(f"    classDef {state} {_COLOURS[state]}")
        members = ",".join(ids[n.name] for n in nodes if n.state == state)
        lines.append(f"    class {members} {state}")
    return "\n".join(lines) + "\n"
