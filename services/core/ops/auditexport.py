"""Audit export (docs/security.md, "Audit export"): the trail's chained rows as JSON
lines, oldest first, from the last id the export wrote (``core.audit_export``) on, to a
file (appended), stdout, or an S3-compatible store (one object per batch). The mark
moves in the transaction that holds its row lock, after the write: an export that fails
between the two writes its rows again next time (at least once; the object's key is the
id range, so S3 just overwrites it). One export at a time: the others skip their turn."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from services.core.db import audit
from services.core.domain import auditchain
from services.core.objects import LogObjects

JSONL = "application/jsonl"


class Sink(Protocol):
    async def write(self, first_id: int, last_id: int, data: bytes) -> None: ...


@dataclass(frozen=True)
class FileSink:
    """Appends to one file, synced to disk before the mark moves."""

    path: Path

    async def write(self, first_id: int, last_id: int, data: bytes) -> None:
        def append() -> None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

        await asyncio.to_thread(append)


class StdoutSink:
    async def write(self, first_id: int, last_id: int, data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


@dataclass(frozen=True)
class ObjectSink:
    """One object per batch, ``PREFIX{first id:020}-{last id:020}.jsonl``: sorted by name
    is sorted by id."""

    objects: LogObjects

    def key(self, first_id: int, last_id: int) -> str:
        return f"{self.objects.prefix}{first_id:020d}-{last_id:020d}.jsonl"

    async def write(self, first_id: int, last_id: int, data: bytes) -> None:
        await self.objects.put(self.key(first_id, last_id), data, JSONL)


def sink_for(to: str, endpoint_url: str | None = None) -> Sink:
    """``-`` (stdout), ``s3://bucket/prefix`` or a file's path."""
    if to == "-":
        return StdoutSink()
    if to.startswith("s3://"):
        bucket, _, prefix = to.removeprefix("s3://").partition("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return ObjectSink(LogObjects(bucket, prefix, endpoint_url))
    return FileSink(Path(to))


def lines(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(auditchain.line(row) for row in rows)


async def export_once(engine: AsyncEngine, sink: Sink, batch: int) -> int:
    """Write the next batch after the mark and move the mark; the rows written (0: none
    left, or another export holds the mark)."""
    async with engine.begin() as conn:
        mark = await audit.export_mark(conn)
        if mark is None:
            return 0
        rows = await audit.chain(conn, mark, batch)
        if not rows:
            return 0
        first, last = int(rows[0]["id"]), int(rows[-1]["id"])
        await sink.write(first, last, lines(rows))
        await audit.set_export_mark(conn, last)
    return len(rows)


async def export_all(engine: AsyncEngine, sink: Sink, batch: int) -> int:
    """Export until nothing is left (on demand); the rows written."""
    total = 0
    while moved := await export_once(engine, sink, batch):
        total += moved
    return total
