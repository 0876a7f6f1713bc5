"""What nodes hand on: the outputs a node keeps when it succeeds, a mapped node's list
of items and its instances, and the outputs downstream templates see."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from libs.common.dag_models import NodeSpec


@dataclass(frozen=True)
class Instance:
    """One item of a mapped node."""

    index: int
    item: Any


def instance_name(node: str, index: int) -> str:
    """``NODE[INDEX]``: node names cannot hold brackets, so this names no other node."""
    return f"{node}[{index}]"


def kept_outputs(
    spec: NodeSpec, written: Mapping[str, Any] | None, paths: Mapping[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The outputs a succeeded node keeps: its declared paths (rendered) and the
    declared values its task wrote; and why it fails instead (a required value missing)."""
    written = written or {}
    kept: dict[str, Any] = {}
    missing = []
    for name, declared in spec.outputs.items():
        if declared.path is not None:
            kept[name] = paths[name]
        elif name in written:
            kept[name] = written[name]
        elif declared.required:
            missing.append(name)
    if missing:
        return kept, f"declared outputs missing from CAIRN_OUTPUTS: {', '.join(missing)}"
    return kept, None


def needs_file(spec: NodeSpec) -> bool:
    """Whether the node's outputs come (partly) from its task's outputs file."""
    return any(declared.path is None for declared in spec.outputs.values())


def map_items(
    spec: NodeSpec, params: Mapping[str, Any], outputs: Mapping[str, Mapping[str, Any]]
) -> tuple[list[Any], str | None]:
    """The items a mapped node runs over, or why it fails: not a list, or too long."""
    if spec.map is None:
        return [], "the node does not map"
    reference = spec.map.over.strip("{} \t")
    head, _, rest = reference.partition(".")
    if head == "params":
        value = params.get(rest)
    else:
        upstream, _, output = rest.rpartition(".outputs.")
        value = outputs.get(upstream, {}).get(output)
    if not isinstance(value, list):
        return [], f"map.over {reference} is not a list (it is {type(value).__name__})"
    if len(value) > spec.map.max_items:
        return [], f"map.over {reference} has {len(value)} items, more than {spec.map.max_items}"
    return value, None


@dataclass(frozen=True)
class Kept:
    """One node row's part in the outputs: its name, the node it is an instance of (or
    None), its index, and its outputs."""

    name: str
    map_of: str | None
    map_index: int | None
    outputs: Mapping[str, Any] | None


def collect(rows: Iterable[Kept], specs: Mapping[str, NodeSpec]) -> dict[str, dict[str, Any]]:
    """Each node's outputs as templates see them: a mapped node's outputs are lists of
    its instances' values in index order (None where an instance kept none)."""
    found: dict[str, dict[str, Any]] = {}
    instances: dict[str, list[Kept]] = {}
    for row in rows:
        if row.map_of is not None:
            instances.setdefault(row.map_of, []).append(row)
        elif row.outputs is not None:
            found[row.name] = dict(row.outputs)
    for node, items in instances.items():
        items.sort(key=lambda row: row.map_index or 0)
        found[node] = {
            name: [(row.outputs or {}).get(name) for row in items] for name in specs[node].outputs
        }
    return found
