"""A worker's liveness rules, pure: how long an attempt may be missing from its
worker's heartbeats before its process counts as gone, and how fresh a worker's times
must be for its agent's turn to leave them unwritten."""

from __future__ import annotations


def missing_grace_s(heartbeat_interval_s: float) -> float:
    """An attempt claimed after the sidecar read its list is not in that beat: give every
    attempt two beats, and a second, before its absence means its process is gone."""
    return 2 * heartbeat_interval_s + 1.0


def turn_fresh_s(heartbeat_timeout_s: float, hang_timeout_s: float) -> float:
    """A turn rewrites its worker's liveness times only when they are older than this, so
    an idle agent's turn is mostly a read. A quarter of the shorter bound: the stored
    times lag a turn by at most this, which the agent counts against its vouched window
    and core's bounds leave ample room for (docs/architecture.md, "Liveness")."""
    return min(heartbeat_timeout_s, hang_timeout_s) / 4
