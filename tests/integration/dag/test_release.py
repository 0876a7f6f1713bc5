"""Releases that core refuses or cannot take now: a batch over core's body limit is cut,
a task core refuses fails only its own node, and no run holds up another's."""

from __future__ import annotations

import pytest

from libs.common.errors import CairnError, is_refusal
from libs.common.models import TaskCreate
from services.dag.engine import by_size
from tests.fixtures.dag import DagServer, Runner, node, states, workflow
from tests.support import TRUE_SHA, Core

LIMIT = 64 * 1024
# Core with a small body limit, so a few nodes make a batch it refuses (413).
pytestmark = [pytest.mark.slow, pytest.mark.core(max_body_bytes=LIMIT)]


def test_a_batch_over_cores_limit_fails_only_the_node_too_large_and_blocks_no_run(
    core: Core, dag: DagServer, runner: Runner, worker: object
) -> None:
    medium = ("ok", *["m" * 8000] * 3)  # 24 KB each: eight together are over the limit
    huge = ("ok", *["h" * 8000] * 12)  # 96 KB: over the limit on its own
    wide = [node(f"m{i}", "root", args=medium) for i in range(8)]
    body = workflow("wide", [node("root"), *wide, node("huge", "root", args=huge)])
    runner.define(body)
    alice = runner.start("wide")
    with dag.client("bob") as bob_http:
        bob = Runner(bob_http)
        small = bob.run(workflow("small", [node("a"), node("b", "a")]), timeout=30)
    assert small["state"] == "succeeded"
    run = runner.wait_end(alice["id"], timeout=30)
    assert states(run) == {"root": "succeeded", "huge": "failed"} | {
        f"m{i}": "succeeded" for i in range(8)
    }
    (failed,) = [n for n in run["nodes"] if n["name"] == "huge"]
    assert "core refused the task" in failed["error"]
    assert run["state"] == "failed"


def _spec(kib8: int) -> TaskCreate:
    artifact = {"uri": "file:///bin/true", "sha256": TRUE_SHA}
    body = {"name": "n", "artifact": artifact, "args": ["a" * 8000] * kib8}
    return TaskCreate.model_validate(body)


def test_release_batches_are_cut_by_encoded_size() -> None:
    items = [(i, _spec(1)) for i in range(10)]
    chunks = by_size(items, 20_000)
    assert [len(c) for c in chunks] == [2, 2, 2, 2, 2]
    assert [i for c in chunks for i, _ in c] == list(range(10))
    assert [len(c) for c in by_size([(0, _spec(3)), (1, _spec(0))], 20_000)] == [1, 1]


def test_only_4xx_refusals_other_than_auth_and_rate_fail_a_node() -> None:
    def status(code: int) -> CairnError:
        error = CairnError("x")
        error.status = code  # type: ignore[misc]
        return error

    assert [is_refusal(status(c)) for c in (413, 422, 409, 403)] == [True] * 4
    assert [is_refusal(status(c)) for c in (401, 429, 500, 503)] == [False] * 4
