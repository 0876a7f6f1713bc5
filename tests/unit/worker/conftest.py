"""Fixtures the worker's unit tests share."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def root() -> Iterator[Path]:
    """A folder for the agent's home, run folder or sources, removed after the test; the
    attempts' uids may pass through it and every parent of it (the tests' tmp_path is
    0700)."""
    folder = Path(tempfile.mkdtemp(prefix="cairn-worker-test-", dir="/var/tmp"))
    folder.chmod(0o711)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)
