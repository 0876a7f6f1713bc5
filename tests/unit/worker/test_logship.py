"""The worker's log shipper (services/worker/logship.py) against a mock core: it batches,
catches up from the file offset after core fails, never sends a byte twice as new, keeps
to its rate, stops at a 409, and ``finish`` sends the rest at once; when core is slower
than ``CAIRN_WORKER_LOG_FLUSH_S``, the rest goes after the report, for a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

import httpx
import pytest

from libs.common.client import CoreClient
from services.worker.logship import MAX_LATE_LOGS, LogShipper
from services.worker.settings import WorkerSettings


class MockCore:
    """Core's log endpoint: keeps what it is sent by (attempt, offset), fails on demand."""

    def __init__(self, failures: int = 0, refuse: set[int] | None = None) -> None:
        self.failures = failures
        self.down = False  # every request fails while set
        self.refuse = refuse or set()
        self.sizes: dict[int, int] = {}
        self.text: dict[int, str] = {}
        self.requests: list[list[dict]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.failures or self.down:
            self.failures = max(0, self.failures - 1)
            raise httpx.ConnectError("core is down", request=request)
        chunks = json.loads(request.content)["chunks"]
        self.requests.append(chunks)
        acks = []
        for c in chunks:
            attempt, size = c["attempt_id"], self.sizes.get(c["attempt_id"], 0)
            if attempt in self.refuse:
                acks.append({**_ack(c, 409, c["offset"]), "detail": "not open"})
                continue
            if c["offset"] >= size:
                self.text[attempt] = self.text.get(attempt, "") + c["text"]
                size = self.sizes[attempt] = c["offset"] + c["length"]
            acks.append(_ack(c, 200, size))
        return httpx.Response(200, json={"items": acks})


class _File:
    """A log file the test writes itself, read as the shipper reads an attempt's log."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def read(self, offset: int, most: int) -> tuple[int, bytes]:
        with self.path.open("rb") as handle:
            handle.seek(offset)
            return offset, handle.read(most)


def _ack(chunk: dict, status: int, size: int) -> dict:
    return {
        "attempt_id": chunk["attempt_id"],
        "offset": chunk["offset"],
        "status": status,
        "next_offset": size,
    }


def _shipper(core: MockCore, **settings: float) -> tuple[LogShipper, CoreClient]:
    client = CoreClient("http://core.test", "token", transport=httpx.MockTransport(core.handle))
    chosen = {"worker_log_interval_s": 0.02, **settings}
    return LogShipper(client, WorkerSettings(**chosen)), client  # type: ignore[arg-type]


async def _until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_lines_of_several_attempts_go_in_one_request_and_finish_sends_the_rest(
    tmp_path: Path,
) -> None:
    async def go() -> MockCore:
        core = MockCore()
        shipper, client = _shipper(core)
        logs = {a: tmp_path / f"{a}.log" for a in (1, 2)}
        for attempt, path in logs.items():
            path.write_text(f"attempt {attempt} starts\n")
            shipper.register(7, attempt, _File(path))
        await _until(lambda: len(core.text) == 2)
        for path in logs.values():
            with path.open("a") as f:
                f.write("more\nno newline yet")
        await asyncio.gather(shipper.finish(1), shipper.finish(2))
        await client.aclose()
        return core

    core = asyncio.run(go())
    assert {c["attempt_id"] for c in core.requests[0]} == {1, 2}
    assert core.text == {a: f"attempt {a} starts\nmore\nno newline yet" for a in (1, 2)}


def test_after_core_fails_it_catches_up_from_the_file_offset_without_doubling(
    tmp_path: Path,
) -> None:
    async def go() -> MockCore:
        core = MockCore(failures=3)
        shipper, client = _shipper(core)
        path = tmp_path / "a.log"
        path.write_text("".join(f"line {i}\n" for i in range(100)))
        shipper.register(7, 1, _File(path))
        await _until(lambda: core.sizes.get(1) == path.stat().st_size)
        await shipper.finish(1)
        await client.aclose()
        return core

    core = asyncio.run(go())
    assert core.text[1] == "".join(f"line {i}\n" for i in range(100))
    offsets = [c["offset"] for batch in core.requests for c in batch]
    assert offsets == sorted(set(offsets))


def test_an_attempt_ships_at_its_rate_and_in_chunks_of_at_most_64_kib(tmp_path: Path) -> None:
    async def go() -> MockCore:
        core = MockCore()
        shipper, client = _shipper(core, worker_log_rate_kib_s=1)
        path = tmp_path / "a.log"
        path.write_text(("x" * 99 + "\n") * 5000)  # 500 kB
        shipper.register(7, 1, _File(path))
        await _until(lambda: len(core.requests) >= 3)
        await client.aclose()
        return core

    core = asyncio.run(go())
    sent = [sum(c["length"] for c in batch) for batch in core.requests]
    assert sent[0] <= 64 * 1024  # the burst
    assert sum(sent[:3]) < 64 * 1024 + 4096  # then about 1 KiB/s
    assert all(c["text"].endswith("\n") for batch in core.requests for c in batch)


def test_a_refused_attempt_is_no_longer_shipped(tmp_path: Path) -> None:
    async def go() -> tuple[MockCore, int]:
        core = MockCore(refuse={1})
        shipper, client = _shipper(core)
        path = tmp_path / "a.log"
        path.write_text("one\n")
        shipper.register(7, 1, _File(path))
        await _until(lambda: core.requests)
        with path.open("a") as f:
            f.write("two\n")
        await asyncio.sleep(0.2)
        await shipper.finish(1)  # forgotten: returns at once
        await client.aclose()
        return core, len(core.requests)

    core, count = asyncio.run(go())
    assert count == 1 and core.text == {}


def test_an_attempt_that_wrote_nothing_more_costs_no_request(tmp_path: Path) -> None:
    async def go() -> MockCore:
        core = MockCore()
        shipper, client = _shipper(core, worker_log_interval_s=60)
        path = tmp_path / "a.log"
        path.write_bytes(b"")
        shipper.register(7, 1, _File(path))
        await shipper.finish(1)
        await client.aclose()
        return core

    assert asyncio.run(go()).requests == []


def test_the_end_core_was_too_slow_for_goes_after_the_report_then_the_file_is_closed(
    tmp_path: Path,
) -> None:
    async def go() -> tuple[MockCore, int | None, list[str], list[str]]:
        core = MockCore()
        shipper, client = _shipper(core, worker_log_flush_s=0.1)
        path = tmp_path / "a.log"
        path.write_text("one\n")
        shipper.register(7, 1, _File(path))
        await _until(lambda: core.sizes.get(1) == 4)
        core.down = True  # core is slow: the end does not go before the report
        with path.open("a") as f:
            f.write("two\nthree\n")
        closed: list[str] = []
        late = await shipper.finish(1)
        shipper.release(1, lambda: closed.append("closed"))
        before = list(closed)  # the file stays open for the rest
        core.down = False
        await _until(lambda: closed)
        await client.aclose()
        return core, late, before, closed

    core, late, before, closed = asyncio.run(go())
    assert late == len("one\ntwo\nthree\n")  # what the report says
    assert core.text[1] == "one\ntwo\nthree\n"
    assert before == [] and closed == ["closed"]


def test_the_end_of_a_log_is_given_up_after_the_tail_time_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def go(tail_s: float) -> tuple[int | None, list[str]]:
        core = MockCore()
        shipper, client = _shipper(core, worker_log_flush_s=0.1, worker_log_tail_s=tail_s)
        path = tmp_path / f"{tail_s}.log"
        path.write_text("one\n")
        shipper.register(7, 1, _File(path))
        await _until(lambda: core.sizes.get(1) == 4)
        core.down = True  # and stays so
        with path.open("a") as f:
            f.write("two\n")
        closed: list[str] = []
        late = await shipper.finish(1)
        shipper.release(1, lambda: closed.append("closed"))
        await _until(lambda: closed, timeout=5)
        await client.aclose()
        return late, closed

    with caplog.at_level(logging.WARNING, "cairn.worker.logs"):
        assert asyncio.run(go(0.3)) == (8, ["closed"])
        assert asyncio.run(go(0)) == (None, ["closed"])  # no tail: given up at the report
    given_up = [r.getMessage() for r in caplog.records if "gave up" in r.getMessage()]
    assert len(given_up) == 2
    assert "4 bytes did not reach core" in given_up[0]


def test_every_running_attempt_of_a_busy_worker_ships_its_lines(tmp_path: Path) -> None:
    # A request has room for 1 MiB; each attempt may send its allowance (up to the burst,
    # 128 KiB at the default rate and interval). Room is what an attempt has to send, not
    # its allowance: else the first 8 attempts registered took a request's room every
    # round, however little they wrote, and the 9th's lines never went while they ran.
    count = 12

    async def go() -> MockCore:
        core = MockCore()
        shipper, client = _shipper(core, worker_log_interval_s=0.5)
        paths = {a: tmp_path / f"{a}.log" for a in range(1, count + 1)}
        for attempt, path in paths.items():
            path.write_text("starts\n")
            shipper.register(7, attempt, _File(path))
        with contextlib.suppress(TimeoutError):
            await _until(lambda: len(core.sizes) == count, timeout=3)
        await client.aclose()
        return core

    core = asyncio.run(go())
    assert sorted(core.sizes) == list(range(1, count + 1))


def test_the_logs_whose_end_goes_after_the_report_are_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Each such log keeps its file open until its end reaches core (``release``): while
    # core is slow, an agent ending attempts faster than the tail time would otherwise
    # hold one more descriptor per attempt (200/s for 50 s: 10,000, past a service's
    # usual limit of 1,024) and fail to open the next attempt's log.
    count = MAX_LATE_LOGS + 40

    async def go() -> tuple[list[int | None], int]:
        core = MockCore()
        shipper, client = _shipper(core, worker_log_flush_s=0.1, worker_log_tail_s=30)
        paths = {a: tmp_path / f"{a}.log" for a in range(1, count + 1)}
        for attempt, path in paths.items():
            path.write_text("one\n")
            shipper.register(7, attempt, _File(path))
        await _until(lambda: len(core.sizes) == count)
        core.down = True  # core is slow: every end goes after its report
        for path in paths.values():
            with path.open("a") as f:
                f.write("two\n")
        closed: list[int] = []
        late = await asyncio.gather(*(shipper.finish(a) for a in paths))
        for attempt in paths:
            shipper.release(attempt, lambda a=attempt: closed.append(a))
        held_open = count - len(closed)
        core.down = False  # the rest goes
        await _until(lambda: len(closed) == count)
        await client.aclose()
        return late, held_open

    with caplog.at_level(logging.WARNING, "cairn.worker.logs"):
        late, held_open = asyncio.run(go())
    assert held_open <= MAX_LATE_LOGS, held_open
    assert sum(n is not None for n in late) == held_open  # the others reported whole-less
    assert any(
        "other logs' ends were already on their way" in r.getMessage() for r in caplog.records
    )
