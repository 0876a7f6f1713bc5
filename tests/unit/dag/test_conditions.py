"""Branch conditions: what parses, what is refused and why, and how JSON values compare."""

from __future__ import annotations

import pytest

from libs.common.dag_models import NodeState, WorkflowCreate
from services.dag.domain.conditions import (
    MAX_DEPTH,
    ConditionError,
    evaluate,
    gate,
    parse_condition,
)

PARAMS = {"env": "prod", "day": 3, "ratio": 0.5, "full": True, "tags": ["a", "b"], "none": None}
OUTPUTS = {"check": {"rows": 120, "ok": True, "meta": {"k": 1}}, "load-1": {"files": [1, 2.0]}}


def holds(text: str) -> bool:
    return evaluate(parse_condition(text), PARAMS, OUTPUTS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('params.env == "prod"', True),
        ("params.env != 'prod'", False),
        ("params.day >= 3 and params.day < 4", True),
        ("1 < params.day <= 3", True),
        ("params.ratio > 0.25 or params.missing == 1", True),
        ("params.full == true and params.full == True", True),
        ("params.full == 1", False),  # a boolean is not a number
        ("params.day == 3.0", True),
        ("params.none == null and params.missing == None", True),
        ('"a" in params.tags and "c" not in params.tags', True),
        ('"ro" in params.env', True),
        ('"k" in nodes.check.outputs.meta', True),
        ("nodes.check.outputs.rows > 100 and nodes.check.outputs.ok", True),
        ('nodes["load-1"].outputs.files == [1, 2]', True),
        ("nodes.check.outputs.absent == null", True),
        ("params.day in (1, 2, 3)", True),
        ("not (params.day > -1)", False),
        # short-circuit: the right side is never compared with null
        ("nodes.check.outputs.absent != null and nodes.check.outputs.absent > 1", False),
        ('params.env < "q"', True),
    ],
)
def test_conditions_evaluate_over_json_values(text: str, expected: bool) -> None:
    assert holds(text) is expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("params.missing > 1", "cannot compare null > a number"),
        ('params.day < "4"', "cannot compare a number < a string"),
        ("not params.day", "not takes true or false, not a number"),
        ("params.env and true", "and takes true or false, not a string"),
        ("params.env", "the condition is a string, not true or false"),
        ("1 in params.day", "cannot look for a number in a number"),
        ("-params.env == 1", "cannot negate a string"),
    ],
)
def test_values_that_cannot_be_compared_are_an_error_with_the_reason(
    text: str, reason: str
) -> None:
    with pytest.raises(ConditionError, match=reason):
        holds(text)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("params.env ==", "does not parse"),
        ("params.env = 'x'", "does not parse"),
        ('__import__("os").system("x")', "is not allowed"),
        ("params.day + 1 > 2", "is not allowed"),
        ("params.env.upper() == 'X'", "is not allowed"),
        ("(lambda: True)()", "is not allowed"),
        ("params.a if params.b else params.c", "is not allowed"),
        ("[x for x in params.tags]", "is not allowed"),
        ('f"{params.env}" == "x"', "is not allowed"),
        ("params.env.__class__ == 1", "is not params.NAME or nodes.NODE.outputs.NAME"),
        ("nodes.check.rows == 1", "is not params.NAME or nodes.NODE.outputs.NAME"),
        ("nodes.check.outputs.rows[0] == 1", "is not params.NAME"),
        ('params["a-b"] == 1', "'a-b' is not a parameter name"),
        ('params["x\\n"] == 1', "is not a parameter name"),
        ("env == 1", "unknown name 'env'"),
        ("params.day == 1j", "is not a JSON literal"),
        ("params.day == b'x'", "is not a JSON literal"),
        ("not " * (MAX_DEPTH + 1) + "true", f"nested deeper than {MAX_DEPTH} levels"),
        ("(" * 300 + "true" + ")" * 300, "does not parse"),
        (" or ".join(["true"] * 300), "more than 256 terms"),
    ],
)
def test_what_is_refused_and_why(text: str, reason: str) -> None:
    with pytest.raises(ConditionError, match=reason.replace("[", r"\[").replace("(", r"\(")):
        parse_condition(text)


def test_a_condition_names_what_it_reads() -> None:
    parsed = parse_condition('params.env == "prod" or nodes["load-1"].outputs.files == []')
    assert parsed.params == {"env"}
    assert parsed.outputs == {("load-1", "files")}


def test_the_gate_readies_skips_with_the_condition_or_fails_with_the_reason() -> None:
    assert gate(parse_condition('params.env == "prod"'), PARAMS, {}) == (NodeState.READY, None)
    assert gate(parse_condition("(params.day   >\n 5)"), PARAMS, {}) == (
        NodeState.SKIPPED,
        "when is false: (params.day > 5)",
    )
    assert gate(parse_condition("params.none > 5"), PARAMS, {}) == (
        NodeState.FAILED,
        "when: cannot compare null > a number",
    )


def test_a_definition_without_when_dumps_and_hashes_as_before_branches_existed() -> None:
    artifact = {"uri": "file:///bin/true", "sha256": "0" * 64}
    nodes = [{"name": "a", "task": {"artifact": artifact}}]
    plain = WorkflowCreate.model_validate({"name": "w", "nodes": nodes})
    assert '"when"' not in plain.model_dump_json()
    gated = WorkflowCreate.model_validate({"name": "w", "nodes": [{**nodes[0], "when": "true"}]})
    assert WorkflowCreate.model_validate_json(gated.model_dump_json()) == gated
