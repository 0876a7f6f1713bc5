"""The private engine the deployment test runs on, with the images built.

Where the tools are missing (no root, no Docker engine package, no debootstrap) the test
is skipped, unless ``CAIRN_REQUIRE_DEPLOY=1`` (as ``.ci/run`` sets, having installed them):
then it fails. ``CAIRN_DEPLOY_ROOT=DIR`` keeps the engine's data root in DIR between runs
(images and build cache stay; for working on the deployment); by default the test starts
from nothing and removes everything it made."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import images
from tests.deploy.engine import PrivateEngine, tools_missing


def _cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a Docker engine of its own)"
    missing = tools_missing()
    if missing:
        return f"needs {', '.join(missing)} (apt-get install docker.io docker-compose debootstrap)"
    return None


@pytest.fixture
def engine() -> Iterator[PrivateEngine]:
    reason = _cannot_run()
    if reason:
        if os.environ.get("CAIRN_REQUIRE_DEPLOY") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    kept = os.environ.get("CAIRN_DEPLOY_ROOT")
    root = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="cairn-deploy-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    made = PrivateEngine(root, keep=bool(kept))
    try:
        started = time.monotonic()
        made.start()
        base = images.base_image(made)
        print(f"base image in {time.monotonic() - started:.0f} s")
        images.build(made, base)
        print(f"engine and images in {time.monotonic() - started:.0f} s")
        yield made
    finally:
        left = made.close()
    assert left == [], f"the deployment test left behind: {left}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The deployment test first: under ``pytest -n 2`` one process runs it from the start
    while the other runs the rest, instead of it starting last."""
    items.sort(key=lambda item: item.get_closest_marker("deploy") is None)
