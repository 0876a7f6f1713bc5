"""Sub-workflow references checked at definition time: no cycle through them (A runs B
runs A, across stored versions) and no nesting deeper than ``MAX_SUBFLOW_DEPTH``.

A workflow version is a ``Key``: (name, version), with version 0 for the definition being
stored. A reference without a version runs the newest version when the run starts: the
definition being stored for its own name, the newest stored one for another name (a
later version of that one is checked when it is stored)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Key = tuple[str, int]
#: a version's sub-workflow nodes: (node, the version it runs)
Edges = Mapping[Key, Sequence[tuple[str, Key]]]


@dataclass(frozen=True)
class Problem:
    """Why the references are refused: the root's node the path leaves by, the path (each
    version as ``name`` for the one being stored, ``name@version`` for a stored one) and
    whether it is a cycle (else: too deep)."""

    node: str
    path: tuple[str, ...]
    cycle: bool

    @property
    def reason(self) -> str:
        shown = " -> ".join(self.path)
        if self.cycle:
            return f"sub-workflows form a cycle: {shown}"
        return f"sub-workflows nest deeper than {len(self.path) - 2} levels: {shown}"


def label(key: Key) -> str:
    name, version = key
    return name if version == 0 else f"{name}@{version}"


def check(root: str, edges: Edges, max_depth: int) -> Problem | None:
    """The first cycle through ``root``'s references, or path deeper than ``max_depth``
    levels below it, depth first in node order; None if there is neither."""
    start: Key = (root, 0)
    path: list[Key] = [start]
    via: list[str] = []
    # A version explored with nothing found at depth d is clean at any depth up to d: a
    # cycle reachable from it would have been found, and its deepest path is no deeper.
    clean: dict[Key, int] = {}

    def walk(key: Key) -> Problem | None:
        depth = len(path) - 1
        if clean.get(key, -1) >= depth:
            return None
        for node, target in _firsts(edges.get(key, ())):
            via.append(node)
            path.append(target)
            if target in path[:-1] or len(path) - 1 > max_depth:
                return Problem(via[0], tuple(label(k) for k in path), target in path[:-1])
            found = walk(target)
            if found is not None:
                return found
            path.pop()
            via.pop()
        clean[key] = depth
        return None

    return walk(start)


def _firsts(refs: Sequence[tuple[str, Key]]) -> list[tuple[str, Key]]:
    """Each version referenced once, by the first node that does."""
    seen: dict[Key, str] = {}
    for node, target in refs:
        seen.setdefault(target, node)
    return [(node, target) for target, node in seen.items()]
