"""An attempt's outputs: small values it hands on to what comes after it (a DAG's
downstream nodes). The attempt finds the path of its outputs file in ``CAIRN_OUTPUTS``
(inside its own working folder) and may write one JSON object there, at most 64 KiB; the
agent reads it when the process has ended and sends it with the report.

The file is written by the attempt's uid, and the agent may be root: it is opened without
following a symbolic link, must be a regular file with one link, and is read up to the
bound only, so an attempt cannot make the agent read anything of the host's.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from pydantic import JsonValue, TypeAdapter, ValidationError

from libs.common.models import (
    MAX_OUTPUTS_BYTES,
    OUTPUTS_ENV,
    OUTPUTS_TOO_DEEP,
    Outputs,
    Report,
    outputs_problem,
)

ENV = OUTPUTS_ENV
FILE = ".cairn-outputs.json"
_OUTPUTS: TypeAdapter[dict[str, JsonValue]] = TypeAdapter(Outputs)


class OutputsError(Exception):
    """A file the attempt wrote is not what it should be (the outputs file: a JSON
    object within the bounds)."""


def with_path(env: Mapping[str, str], workdir: Path) -> dict[str, str]:
    """The attempt's environment with ``CAIRN_OUTPUTS`` naming its outputs file."""
    return {**env, ENV: _path(workdir)}


@functools.lru_cache(maxsize=64)
def _path(workdir: Path) -> str:
    """The outputs file's path in ``workdir`` (every attempt on a tmpfs has the same)."""
    return str(workdir / FILE)


def read_bounded(path: Path, limit: int, name: str) -> bytes | None:
    """A file an attempt wrote (its variable ``name`` says where), or None when there is
    none; ``OutputsError`` when it is not a regular file of one link or is over ``limit``
    bytes. Never follows a symbolic link, never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputsError(f"{name}: cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise OutputsError(f"{name}: not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OutputsError(f"{name}: larger than {limit} bytes")
    return data


def read(workdir: Path) -> dict[str, JsonValue] | None:
    """The outputs the attempt wrote, or None when it wrote no file."""
    data = read_bounded(workdir / FILE, MAX_OUTPUTS_BYTES, ENV)
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except RecursionError:
        raise OutputsError(f"{ENV}: {OUTPUTS_TOO_DEEP}") from None
    except ValueError as exc:
        raise OutputsError(f"{ENV}: not a JSON object of outputs: {exc}"[:1000]) from None
    # Refused here with its reason (a report must carry what core is sent: a lone
    # surrogate or a depth the turn's encoder refuses used to wedge the agent's turns).
    problem = outputs_problem(doc)
    if problem is not None:
        raise OutputsError(f"{ENV}: {problem}")
    try:
        return _OUTPUTS.validate_python(doc)
    except (ValueError, ValidationError) as exc:
        reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise OutputsError(f"{ENV}: not a JSON object of outputs: {reason}"[:1000]) from None


def attach(report: Report | None, workdir: Path) -> Report | None:
    """``report`` with the attempt's outputs. A succeeded attempt whose file is broken
    fails, not retried: it would write the same again."""
    if report is None or report.outcome != "succeeded":
        return report
    try:
        found = read(workdir)
    except OutputsError as exc:
        return report.model_copy(
            update={"outcome": "failed", "error": str(exc), "retryable": False}
        )
    return report if found is None else report.model_copy(update={"outputs": found})
