"""Branch conditions: a node's ``when``, a small expression over the run's parameters and
its upstream nodes' outputs, such as
``params.env == "prod" and nodes.check.outputs.rows > 0``.

The text is parsed with Python's ``ast`` (expression mode) and only a whitelist of node
types is accepted; the tree is compiled into terms of our own, and those are evaluated
over JSON values. Python never evaluates anything. Bounded: ``MAX_WHEN_CHARS`` characters,
``MAX_DEPTH`` levels of nesting, ``MAX_TERMS`` terms.

Values are JSON's: equality is strict (``true`` is not ``1``), ``<`` and friends compare
two numbers or two strings, ``in`` looks in a list (or for a substring, or for an
object's key), ``and``, ``or`` and ``not`` take booleans and the whole condition must be
one. Anything else is an evaluation error (``ConditionError``), which fails the node.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from libs.common.dag_models import NODE_FINAL, NodeState

MAX_DEPTH = 32
MAX_TERMS = 256

Term = tuple[Any, ...]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a parameter's or an output's (whole)
_LITERAL_NAMES = {"true": True, "false": False, "null": None}
_COMPARISONS: dict[type[ast.cmpop], str] = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
}


class ConditionError(ValueError):
    """A condition that does not parse, names what it may not, or cannot be evaluated
    over the values it met; its text is the reason."""


@dataclass(frozen=True)
class Condition:
    """A parsed condition: its text, its compiled term, and what it reads."""

    text: str
    term: Term
    params: frozenset[str]
    #: (upstream node, output name) pairs it reads
    outputs: frozenset[tuple[str, str]]

    @property
    def nodes(self) -> frozenset[str]:
        """The nodes whose outputs it reads."""
        return frozenset(node for node, _ in self.outputs)


class _Compiler:
    def __init__(self) -> None:
        self.terms = 0
        self.params: set[str] = set()
        self.outputs: set[tuple[str, str]] = set()

    def compile(self, node: ast.expr, depth: int) -> Term:
        self.terms += 1
        if depth > MAX_DEPTH:
            raise ConditionError(f"nested deeper than {MAX_DEPTH} levels")
        if self.terms > MAX_TERMS:
            raise ConditionError(f"more than {MAX_TERMS} terms")
        down = depth + 1
        if isinstance(node, ast.Constant | ast.Name):
            return ("value", _literal(node))
        if isinstance(node, ast.List | ast.Tuple):
            return ("list", tuple(self.compile(item, down) for item in node.elts))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
            op = "not" if isinstance(node.op, ast.Not) else "-"
            return (op, self.compile(node.operand, down))
        if isinstance(node, ast.BoolOp):
            op = "and" if isinstance(node.op, ast.And) else "or"
            return (op, tuple(self.compile(value, down) for value in node.values))
        if isinstance(node, ast.Compare):
            ops = [_COMPARISONS[type(op)] for op in node.ops]
            rights = [self.compile(right, down) for right in node.comparators]
            return ("compare", self.compile(node.left, down), tuple(zip(ops, rights, strict=True)))
        if isinstance(node, ast.Attribute | ast.Subscript):
            return self._reference(node)
        raise ConditionError(f"{_shown(node)} is not allowed in a condition")

    def _reference(self, node: ast.Attribute | ast.Subscript) -> Term:
        path = _path(node)
        if path is not None and len(path) == 2 and path[0] == "params":
            _named(path[1], "parameter")
            self.params.add(path[1])
            return ("param", path[1])
        if path is not None and len(path) == 4 and path[0] == "nodes" and path[2] == "outputs":
            _named(path[3], "output")
            self.outputs.add((path[1], path[3]))
            return ("output", path[1], path[3])
        raise ConditionError(
            f"{_shown(node)} is not params.NAME or nodes.NODE.outputs.NAME"
            ' (nodes["NODE"] for a name with - or .)'
        )


def _named(name: str, what: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConditionError(f"'{name[:64]}' is not a {what} name")


def _literal(node: ast.Constant | ast.Name) -> Any:
    if isinstance(node, ast.Name):
        if node.id not in _LITERAL_NAMES:
            raise ConditionError(
                f"unknown name '{node.id}': use params.NAME, nodes.NODE.outputs.NAME,"
                " true, false or null"
            )
        return _LITERAL_NAMES[node.id]
    value = node.value
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ConditionError(f"{value!r} is not a JSON literal")


def _path(node: ast.expr) -> list[str] | None:
    """``a.b["c"].d`` as ``[a, b, c, d]``; None for anything else."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            parts.append(node.slice.value)
            node = node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1]
        else:
            return None


def _shown(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # whatever the tree, the reason still names its kind
        text = type(node).__name__
    return f"'{text[:60]}'"


def parse_condition(text: str) -> Condition:
    """Parse and check ``text``; ``ConditionError`` says why it is refused."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        where = f" (column {exc.offset})" if exc.offset else ""
        raise ConditionError(f"does not parse: {exc.msg}{where}") from None
    except (RecursionError, MemoryError, ValueError) as exc:
        raise ConditionError(f"does not parse: {type(exc).__name__}") from None
    compiler = _Compiler()
    try:
        term = compiler.compile(tree.body, 1)
    except RecursionError:
        raise ConditionError(f"nested deeper than {MAX_DEPTH} levels") from None
    return Condition(text, term, frozenset(compiler.params), frozenset(compiler.outputs))


# --- evaluation over JSON values -----------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def equal(a: Any, b: Any) -> bool:
    """JSON equality: a boolean equals only a boolean, 1 equals 1.0."""
    if _number(a) and _number(b):
        return bool(a == b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _within(a: Any, b: Any) -> bool:
    if isinstance(b, list):
        return any(equal(a, item) for item in b)
    if isinstance(b, str) and isinstance(a, str):
        return a in b
    if isinstance(b, dict) and isinstance(a, str):
        return a in b
    raise ConditionError(f"cannot look for {_kind(a)} in {_kind(b)}")


def _ordered(op: str, a: Any, b: Any) -> bool:
    if not ((_number(a) and _number(b)) or (isinstance(a, str) and isinstance(b, str))):
        raise ConditionError(f"cannot compare {_kind(a)} {op} {_kind(b)}")
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "==": equal,
    "!=": lambda a, b: not equal(a, b),
    "in": _within,
    "not in": lambda a, b: not _within(a, b),
}


def _boolean(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ConditionError(f"{what} takes true or false, not {_kind(value)}")
    return value


class _Values:
    def __init__(self, params: Mapping[str, Any], outputs: Mapping[str, Mapping[str, Any]]):
        self.params = params
        self.outputs = outputs

    def of(self, term: Term) -> Any:
        kind = term[0]
        if kind == "value":
            return term[1]
        if kind == "param":
            return self.params.get(term[1])
        if kind == "output":
            return self.outputs.get(term[1], {}).get(term[2])
        if kind == "list":
            return [self.of(item) for item in term[1]]
        if kind in ("and", "or"):
            return self._either(kind, term[1])
        if kind == "compare":
            return self._compare(term)
        return self._unary(kind, self.of(term[1]))

    def _unary(self, op: str, value: Any) -> Any:
        if op == "not":
            return not _boolean(value, "not")
        if not _number(value):
            raise ConditionError(f"cannot negate {_kind(value)}")
        return -value

    def _either(self, op: str, operands: tuple[Term, ...]) -> bool:
        stop = op == "or"  # and: the first false decides; or: the first true
        for operand in operands:
            if _boolean(self.of(operand), op) is stop:
                return stop
        return not stop

    def _compare(self, term: Term) -> bool:
        left = self.of(term[1])
        for op, right_term in term[2]:
            right = self.of(right_term)
            compare = _COMPARE.get(op)
            holds = compare(left, right) if compare else _ordered(op, left, right)
            if not holds:
                return False
            left = right
        return True


def evaluate(
    condition: Condition, params: Mapping[str, Any], outputs: Mapping[str, Mapping[str, Any]]
) -> bool:
    """Whether ``condition`` holds for the run's ``params`` and the ``outputs`` its nodes
    kept (``data.collect``); a missing value is null. ``ConditionError`` when it cannot be
    evaluated over these values."""
    try:
        value = _Values(params, outputs).of(condition.term)
    except RecursionError:  # equality of two outputs nested thousands of levels deep
        raise ConditionError("a value nested too deeply to compare") from None
    if not isinstance(value, bool):
        raise ConditionError(f"the condition is {_kind(value)}, not true or false")
    return value


def gate(
    condition: Condition, params: Mapping[str, Any], outputs: Mapping[str, Mapping[str, Any]]
) -> tuple[NodeState, str | None]:
    """What a node whose rule is met becomes: still ``ready`` when its condition holds,
    ``skipped`` (and why) when it does not, ``failed`` (and why) when it cannot be
    evaluated."""
    try:
        holds = evaluate(condition, params, outputs)
    except ConditionError as exc:
        return NodeState.FAILED, f"when: {exc}"
    if holds:
        return NodeState.READY, None
    return NodeState.SKIPPED, f"when is false: {_brief(condition.text)}"


def _brief(text: str, most: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 1] + "…"


def decide(
    gated: Mapping[str, Condition],
    states: Mapping[str, NodeState],
    params: Mapping[str, Any],
    outputs: Mapping[str, Mapping[str, Any]],
) -> dict[str, tuple[NodeState, str | None]]:
    """What each node whose trigger rule was just met, and which has a condition,
    becomes: ``pending`` again while a node its condition reads has not ended (a rule
    such as ``one_success`` or ``always`` is met early; waiting makes the verdict the
    same whatever order the outcomes arrive in), else as ``gate`` says."""
    decided: dict[str, tuple[NodeState, str | None]] = {}
    for name, condition in gated.items():
        if any(states[read] not in NODE_FINAL for read in condition.nodes):
            decided[name] = (NodeState.PENDING, None)
        else:
            decided[name] = gate(condition, params, outputs)
    return decided
