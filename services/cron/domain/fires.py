"""What became of a fire: the outcome the sender records for one schedule's slot."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

Outcome = Literal["submitted", "failed", "pending", "missed"]


@dataclass(frozen=True)
class Result:
    schedule_id: int
    fire_time: datetime
    outcome: Outcome
    task_id: int | None = None
    run_id: int | None = None
    detail: str | None = None
    submitted_at: datetime | None = None
