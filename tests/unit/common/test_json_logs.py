"""Structured logs: one JSON object a line off a terminal, with the ids a line is about."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from libs.common import logs


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    monkeypatch.delenv("CAIRN_LOG_FORMAT", raising=False)
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    out = io.StringIO()
    logs.setup("core", "debug", out)
    yield out
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved:
        root.addHandler(handler)
    root.setLevel(level)


def lines(out: io.StringIO) -> list[dict]:
    found = [json.loads(line) for line in out.getvalue().splitlines()]
    return [line for line in found if line["logger"] == "cairn.test"]


def test_a_line_is_json_with_the_ids_of_its_context_and_of_extra(stream: io.StringIO) -> None:
    log = logging.getLogger("cairn.test")
    with logs.log_context(task_id=7, attempt_id=70):
        log.info("attempt %s ends", 70, extra={"worker_id": 3})
    log.warning("no ids here")
    first, second = lines(stream)
    assert first["message"] == "attempt 70 ends"
    assert (first["task_id"], first["attempt_id"], first["worker_id"]) == (7, 70, 3)
    assert first["level"] == "info"
    assert first["service"] == "core"
    assert first["logger"] == "cairn.test"
    assert "time" in first
    assert "task_id" not in second


def test_ids_bound_in_an_asyncio_task_stay_in_that_task(stream: io.StringIO) -> None:
    log = logging.getLogger("cairn.test")

    async def attempt(n: int) -> None:
        logs.bind(attempt_id=n)
        await asyncio.sleep(0)
        log.info("running")

    async def main() -> None:
        with logs.log_context(worker_id=5, schedule_id=1, run_id=2):
            await asyncio.gather(attempt(1), attempt(2))
        log.info("after")

    asyncio.run(main())
    found = lines(stream)
    assert sorted(line["attempt_id"] for line in found[:2]) == [1, 2]
    assert all(line["worker_id"] == 5 and line["run_id"] == 2 for line in found[:2])
    assert "worker_id" not in found[2]


def test_an_exception_travels_in_the_line(stream: io.StringIO) -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("cairn.test").exception("failed")
    [line] = lines(stream)
    assert "RuntimeError: boom" in line["exception"]


def test_the_format_follows_the_terminal_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("CAIRN_LOG_FORMAT", raising=False)
    assert logs.wants_json(io.StringIO())
    assert not logs.wants_json(Tty())
    monkeypatch.setenv("CAIRN_LOG_FORMAT", "json")
    assert logs.wants_json(Tty())
    monkeypatch.setenv("CAIRN_LOG_FORMAT", "text")
    assert not logs.wants_json(io.StringIO())


def test_an_unknown_id_is_refused() -> None:
    with pytest.raises(ValueError, match="owner"), logs.log_context(owner="x"):
        pass
