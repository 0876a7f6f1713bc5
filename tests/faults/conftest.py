"""Fixtures of the fault tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import Workers


@pytest.fixture
def workers() -> Iterator[Workers]:
    """Start worker agents with ``workers.start(core, home, name, ...)``; all are killed
    and reaped when the test ends."""
    started = Workers()
    yield started
    started.stop_all()
