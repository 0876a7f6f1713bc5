"""What the agent and its sidecar share.

The agent tells its sidecar its pid and each attempt's process group, cgroups and uid on
a ``Board``: memory the two share (a memfd the sidecar inherits), rewritten as attempts
come and go, at least once before every exec. The sidecar reads it at every heartbeat and,
when the agent is gone, to kill what it left. A write is a copy into memory, no file
replaced on disk: on a busy disk that cost the agent milliseconds per attempt, inside
its event loop. After the two halves the board holds the agent's pulse: the monotonic
time its event loop last turned (``pulse``), which the sidecar watches for a hung agent.
The sidecar writes ``answer.json`` (core's answer to its last heartbeat,
once an interval) in the worker's folder, replaced atomically.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

ANSWER = "answer.json"
#: its threads left to opens or reads of ``file://`` sources that did not answer
#: (``artifacts.hung_opens``), and its spawn helpers' checkers of such sources still
#: held aside (``spawner.hung_checkers``)
Hung = tuple[int, int]

_HEADER = struct.Struct("=QII")  # sequence number, length, crc32 of the payload
#: each half's room (the memfd is sparse: only written pages take memory)
HALF = 16 * 2**20
#: the pulse: one time written twice, so a read torn by a write is seen as such, around
#: what of the agent hangs on sources that did not answer (``Hung``)
_PULSE = struct.Struct("=dIId")


class Board:
    """Two halves written in turn, each with a sequence number and a checksum: a reader
    takes the newest whole half, so a write cut short (by the agent's death, or read
    while it is made) leaves the one before it readable."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._seq = 0

    @classmethod
    def create(cls) -> Board:
        """A fresh board; its descriptor is close-on-exec (pass it on with ``pass_fds``)."""
        fd = os.memfd_create("cairn-attempts", os.MFD_CLOEXEC)
        os.ftruncate(fd, 2 * HALF + _PULSE.size)
        return cls(fd)

    def pulse(self, at: float, hung: Hung = (0, 0)) -> None:
        """Record that the agent's loop turned at ``at`` (``time.monotonic()``), and what
        of it hangs on sources then."""
        os.pwrite(self.fd, _PULSE.pack(at, *hung, at), 2 * HALF)

    def pulse_at(self) -> float | None:
        """When the agent's loop last turned (``time.monotonic()``); None before its first."""
        return self._pulse()[0]

    def hung(self) -> Hung:
        """What of the agent hung on sources at its last pulse (``Hung``)."""
        return self._pulse()[1]

    def _pulse(self) -> tuple[float | None, Hung]:
        for _ in range(5):
            first, threads, checkers, second = _PULSE.unpack(
                os.pread(self.fd, _PULSE.size, 2 * HALF)
            )
            if first == second:
                return first or None, (threads, checkers)
        return None, (0, 0)

    def write(self, value: dict[str, Any]) -> None:
        self.write_json(json.dumps(value, separators=(",", ":")).encode())

    def write_json(self, data: bytes) -> None:
        """Write a value already encoded as JSON (one object); nothing once closed (a
        release that ends as the agent exits: its descriptor's number may name another
        file by then)."""
        if self.fd < 0:
            return
        if len(data) > HALF - _HEADER.size:
            raise ValueError(f"the board holds {HALF} bytes, not {len(data)}")
        self._seq += 1
        at = (self._seq % 2) * HALF
        os.pwrite(self.fd, b"\0" * _HEADER.size, at)  # no half looks whole while written
        os.pwrite(self.fd, data, at + _HEADER.size)
        os.pwrite(self.fd, _HEADER.pack(self._seq, len(data), zlib.crc32(data)), at)

    def read(self) -> dict[str, Any]:
        """The newest whole value; ``{}`` if none was ever written."""
        for _ in range(5):
            newest: tuple[int, bytes] | None = None
            for at in (0, HALF):
                seq, length, crc = _HEADER.unpack(os.pread(self.fd, _HEADER.size, at))
                if seq == 0 or length > HALF - _HEADER.size:
                    continue
                data = os.pread(self.fd, length, at + _HEADER.size)
                if zlib.crc32(data) == crc and (newest is None or seq > newest[0]):
                    newest = (seq, data)
            if newest is not None:
                value: dict[str, Any] = json.loads(newest[1])
                return value
        return {}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Holdings:
    """What the board says kills what is left of the agent's attempts: the cgroup folders
    and uid of each that has them, which the sidecar kills when the agent is gone, kept
    as they change, each attempt's folders encoded once. The board is written a few
    times an attempt, each time whole: with 64 attempts held, encoding their folders at
    each write cost 45 µs; with them kept encoded a write costs about 10 µs (`timeit`, 2026-12-08)."""

    def __init__(self) -> None:
        self._cgroups: dict[int, str] = {}  # its entry, encoded: ``"id":["folder",...]``
        self._uids: dict[int, int] = {}

    def confine(self, attempt: int, folders: Sequence[str] | None, uid: int | None) -> None:
        """What kills what is left of the attempt: its cgroup's ``folders``, its ``uid``."""
        if folders is not None:
            self._cgroups[attempt] = f'"{attempt}":{orjson.dumps(sorted(folders)).decode()}'
        if uid is not None:
            self._uids[attempt] = uid

    def unconfine(self, attempt: int) -> None:
        """Nothing of the attempt is left to kill."""
        self._cgroups.pop(attempt, None)
        self._uids.pop(attempt, None)

    def encode(
        self, agent_pid: int, seen: int, pids: Mapping[int, int], starting: Collection[int]
    ) -> bytes:
        """The board's value: the agent's pid, the highest attempt id a turn has handed
        it (``seen``), and each attempt it holds with its process's pid (0 while it has
        none: prepared, or ended and not yet reported; those ``starting`` -1, which the
        sidecar counts as started), the cgroups and uids kept here."""
        if starting:
            pids = {**pids, **dict.fromkeys(starting, -1)}
        keyed = orjson.OPT_NON_STR_KEYS
        attempts = orjson.dumps(pids, option=keyed).decode()
        uids = orjson.dumps(self._uids, option=keyed).decode()
        cgroups = ",".join(self._cgroups.values())
        return (
            f'{{"agent_pid":{agent_pid},"seen":{seen},"attempts":{attempts},'
            f'"cgroups":{{{cgroups}}},"uids":{uids}}}'
        ).encode()


def write(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any]:
    try:
        value: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return value


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
