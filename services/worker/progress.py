"""A running attempt's progress, its checkpoint and its fencing token (docs/progress.md).

The attempt finds in its environment, beside ``CAIRN_OUTPUTS`` (``outputs``), in its own
working folder:

- ``CAIRN_PROGRESS``: a file it may replace at any time with a JSON object
  ``{"fraction": 0.4, "message": "step 2 of 5"}`` (both optional; at most 4 KiB);
- ``CAIRN_CHECKPOINT_OUT``: a file it may replace with an opaque checkpoint of at most
  64 KiB, which the next attempt of its task is given;
- ``CAIRN_CHECKPOINT``: only when an earlier attempt saved one, a copy of the latest;
- ``CAIRN_FENCING_TOKEN`` and ``CAIRN_FENCING_URL``: the attempt's token, and where core
  answers whether it is still current.

The agent looks at the two files every ``CAIRN_WORKER_PROGRESS_POLL_S`` and once more when
the process has ended; what changed goes to core with the next turn. A file it cannot
take (over its bound, not JSON, a fraction outside 0..1, not a regular file) is skipped
with a line in the attempt's log, and the last good one stays. The files are written by
the attempt's uid and read by an agent that may be root, the same way as the outputs
file (``outputs.read_bounded``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from base64 import b64encode
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from libs.common.models import (
    MAX_CHECKPOINT_BYTES,
    MAX_PROGRESS_MESSAGE,
    Assignment,
    ProgressNote,
)
from services.worker.isolation import Identity
from services.worker.outputs import OutputsError, read_bounded

PROGRESS_ENV = "CAIRN_PROGRESS"
CHECKPOINT_OUT_ENV = "CAIRN_CHECKPOINT_OUT"
CHECKPOINT_ENV = "CAIRN_CHECKPOINT"
FENCING_TOKEN_ENV = "CAIRN_FENCING_TOKEN"  # noqa: S105 - a variable name
FENCING_URL_ENV = "CAIRN_FENCING_URL"
PROGRESS_FILE = ".cairn-progress.json"
CHECKPOINT_OUT_FILE = ".cairn-checkpoint.out"
CHECKPOINT_FILE = ".cairn-checkpoint"
MAX_PROGRESS_BYTES = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: (inode, modification time in ns, size): a file replaced or written again differs
Stamp = tuple[int, int, int]


def with_paths(
    env: Mapping[str, str], workdir: Path, assignment: Assignment, core_url: str
) -> dict[str, str]:
    """The attempt's environment with its progress and checkpoint files and its token."""
    progress, checkpoint_out, checkpoint = _paths(workdir)
    out = {**env, PROGRESS_ENV: progress, CHECKPOINT_OUT_ENV: checkpoint_out}
    if assignment.checkpoint is not None:
        out[CHECKPOINT_ENV] = checkpoint
    if assignment.fencing_token is not None:
        out[FENCING_TOKEN_ENV] = assignment.fencing_token
        out[FENCING_URL_ENV] = core_url.rstrip("/") + "/v1/fencing"
    return out


@functools.lru_cache(maxsize=64)
def _paths(workdir: Path) -> tuple[str, str, str]:
    """The progress, checkpoint-out and checkpoint files' paths in ``workdir`` (made once
    for the few workdirs there are: every attempt on a tmpfs has the same)."""
    return (
        str(workdir / PROGRESS_FILE),
        str(workdir / CHECKPOINT_OUT_FILE),
        str(workdir / CHECKPOINT_FILE),
    )


def place_checkpoint(workdir: Path, data: bytes, identity: Identity | None) -> None:
    """Put the task's latest checkpoint where ``CAIRN_CHECKPOINT`` says, readable by the
    attempt's uid only (before its process starts)."""
    path = workdir / CHECKPOINT_FILE
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o400)
    with os.fdopen(fd, "wb") as f:
        if identity is not None:
            os.fchown(f.fileno(), identity.uid, identity.gid)
        f.write(data)


def read_progress(workdir: Path) -> dict[str, object] | None:
    """What the progress file says (``ProgressNote``'s fields), None when it is gone;
    ``OutputsError`` when it cannot be taken. The message is cut to its bound and its
    control characters made spaces."""
    data = read_bounded(workdir / PROGRESS_FILE, MAX_PROGRESS_BYTES, PROGRESS_ENV)
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except RecursionError:
        # 4 KiB of "[" is deeper than the parser's recursion limit
        raise OutputsError(
            f"{PROGRESS_ENV}: not JSON: nested deeper than the agent parses"
        ) from None
    except ValueError:
        raise OutputsError(f"{PROGRESS_ENV}: not JSON") from None
    if not isinstance(doc, dict):
        raise OutputsError(f"{PROGRESS_ENV}: not a JSON object")
    fraction, message = doc.get("fraction"), doc.get("message")
    if fraction is not None and not _is_fraction(fraction):
        raise OutputsError(f"{PROGRESS_ENV}: fraction must be a number from 0 to 1")
    if message is not None and not isinstance(message, str):
        raise OutputsError(f"{PROGRESS_ENV}: message must be a string")
    if message is not None and not message.isascii():
        try:
            message.encode()
        except UnicodeEncodeError:
            # a JSON "\\ud800" escape: no note (nor any turn) can carry it
            raise OutputsError(
                f"{PROGRESS_ENV}: message holds an unpaired surrogate (such as \\ud800)"
            ) from None
    return {
        "progress": True,
        "fraction": None if fraction is None else float(fraction),
        "message": None if message is None else _CONTROL.sub(" ", message)[:MAX_PROGRESS_MESSAGE],
    }


def _is_fraction(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and 0 <= value <= 1


def read_checkpoint(workdir: Path) -> bytes | None:
    """The checkpoint the attempt saved, None when there is none."""
    return read_bounded(workdir / CHECKPOINT_OUT_FILE, MAX_CHECKPOINT_BYTES, CHECKPOINT_OUT_ENV)


def merge(older: ProgressNote | None, newer: ProgressNote) -> ProgressNote:
    """One note for core from two not yet sent: the newer progress, the newer checkpoint."""
    if older is None:
        return newer
    said = newer if newer.progress else older
    checkpoint = newer.checkpoint if newer.checkpoint is not None else older.checkpoint
    return newer.model_copy(
        update={
            "progress": said.progress,
            "fraction": said.fraction,
            "message": said.message,
            "checkpoint": checkpoint,
        }
    )


@dataclass
class Watch:
    """One running attempt's two files, as last seen; when it last wrote either
    (``changed_at``, the event loop's clock), and after how long without a write it has
    stalled (``stall_s``, the task's ``progress_timeout_s``; None: never)."""

    workdir: Path
    changed_at: float
    stall_s: float | None = None
    stamps: dict[str, Stamp | None] = field(
        default_factory=lambda: {PROGRESS_FILE: None, CHECKPOINT_OUT_FILE: None}
    )

    def look(self, attempt_id: int, now: float) -> tuple[ProgressNote | None, list[str]]:
        """What the attempt wrote since the last look, as a note for core (None:
        nothing new it could take), and why what it wrote could not be taken."""
        fields: dict[str, object] = {}
        problems: list[str] = []
        if self._changed(PROGRESS_FILE, now):
            try:
                fields.update(read_progress(self.workdir) or {})
            except OutputsError as exc:
                problems.append(str(exc))
        if self._changed(CHECKPOINT_OUT_FILE, now):
            try:
                data = read_checkpoint(self.workdir)
            except OutputsError as exc:
                problems.append(str(exc))
            else:
                if data is not None:
                    fields["checkpoint"] = b64encode(data).decode()
        if not fields:
            return None, problems
        fields.setdefault("progress", False)
        return ProgressNote.model_validate({"attempt_id": attempt_id, **fields}), problems

    def stalled(self, now: float) -> bool:
        return self.stall_s is not None and now - self.changed_at > self.stall_s

    def _changed(self, name: str, now: float) -> bool:
        try:
            info = os.lstat(self.workdir / name)
        except (FileNotFoundError, NotADirectoryError):
            return False
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        if stamp == self.stamps[name]:
            return False
        self.stamps[name] = stamp
        self.changed_at = now
        return True
