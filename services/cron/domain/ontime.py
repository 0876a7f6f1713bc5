"""When a fire is sent and when its task may start. Pure functions, no I/O.

A fire of a task target with overlap ``allow`` is sent ahead: ``lead`` (or the jitter, if
longer) before its task's start, with ``run_at`` = that start (the slot plus the
schedule's jitter), so core starts it on time however
many are due together. Fires whose overlap policy needs the previous run's state at the
slot (``forbid``, ``replace``), and workflow targets (the DAG service starts a run when
asked), are sent at the slot plus the jitter.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta


def jitter(schedule_id: int, jitter_s: int) -> timedelta:
    """The schedule's fixed offset, 0 to ``jitter_s`` seconds (to the millisecond),
    derived from its id: the same on every replica and after every restart."""
    if jitter_s <= 0:
        return timedelta(0)
    digest = hashlib.sha256(f"cairn-cron-jitter:{schedule_id}".encode()).digest()
    return timedelta(milliseconds=int.from_bytes(digest[:8], "big") % (jitter_s * 1000 + 1))


def sent_ahead(kind: str, overlap_policy: str, lead: timedelta) -> bool:
    return lead > timedelta(0) and kind == "task" and overlap_policy == "allow"


def send_at(
    slot: datetime,
    schedule_id: int,
    kind: str,
    overlap_policy: str,
    jitter_s: int,
    lead: timedelta,
) -> datetime:
    """The instant the engine sends the fire of ``slot``."""
    start = slot + jitter(schedule_id, jitter_s)
    if not sent_ahead(kind, overlap_policy, lead):
        return start
    # The lead before the start, or the jitter if longer: never after the slot (what is
    # sent before its slot can be withdrawn by a change), and a jittered burst is sent
    # spread out as it starts. On the whole second before, so that it goes in batches (a
    # request and a transaction per second's fires, not per fire).
    return (start - max(lead, timedelta(seconds=jitter_s))).replace(microsecond=0)
