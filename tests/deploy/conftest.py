"""The private engine the deployment test runs on, with the image built.

Where the tools are missing (no root, no Docker engine package, no mmdebstrap) the test
is skipped, unless ``CAIRN_REQUIRE_DEPLOY=1`` (as ``.ci/run`` sets, having installed them):
then it fails. Each run starts from nothing and removes everything it made; the seconds
each step took are printed at the end of the run."""

from __future__ import annotations

import os
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import TIMES, images
from tests.deploy.engine import PrivateEngine, tools_missing


def _cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a Docker engine of its own)"
    missing = tools_missing()
    if missing:
        return f"needs {', '.join(missing)} (apt-get install docker.io docker-compose mmdebstrap)"
    return None


@pytest.fixture
def engine() -> Iterator[PrivateEngine]:
    reason = _cannot_run()
    if reason:
        if os.environ.get("CAIRN_REQUIRE_DEPLOY") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    made = PrivateEngine(Path(tempfile.mkdtemp(prefix="cairn-deploy-", dir="/tmp")))
    try:
        started = time.monotonic()
        made.start()
        TIMES["engine start"] = time.monotonic() - started
        TIMES.update(images.prepare(made))
        yield made
    finally:
        cpu = made.container_cpu_seconds()
        if cpu is not None:
            TIMES["CPU seconds used in containers (builds included)"] = cpu
        started = time.monotonic()
        left = made.close()
        TIMES["teardown (containers, daemons, tmpfs, bridge)"] = time.monotonic() - started
        # mmdebstrap, pip, the docker clients, dockerd and containerd (not the containers).
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        TIMES["CPU seconds of the test's own children"] = usage.ru_utime + usage.ru_stime
    assert left == [], f"the deployment test left behind: {left}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMES:
        terminalreporter.section("deployment test: seconds per step")
        for step, seconds in TIMES.items():
            terminalreporter.write_line(f"{seconds:7.1f}  {step}")
