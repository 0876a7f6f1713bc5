"""How much of an attempt's log is kept: one bound and one rule for core's copy and the
worker's file (docs/logs.md). Both keep the attempt's last ``CAIRN_LOG_MAX_BYTES`` (the end
of a log is where the error is); what came before is dropped and a marker line first says
how much."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

#: ``CAIRN_LOG_MAX_BYTES`` unless set: what one attempt's log keeps, its last 16 MiB
DEFAULT_LOG_MAX_BYTES = 16 * 2**20
#: the setting's bounds, the same for core and the worker agent
LogMaxBytes = Annotated[int, Field(ge=2**20, le=2**31)]


def dropped_marker(count: int, cap: int) -> str:
    """The line a log kept to its last ``cap`` bytes starts with, ``count`` bytes gone."""
    return (
        f"[cairn: the first {count} bytes of this log were dropped:"
        f" an attempt keeps its last {cap // 2**20} MiB]\n"
    )
