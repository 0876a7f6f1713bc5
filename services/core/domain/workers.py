"""A worker's liveness rules, pure: how long an attempt may be missing from its
worker's heartbeats before its process counts as gone."""

from __future__ import annotations


def missing_grace_s(heartbeat_interval_s: float) -> float:
    """An attempt claimed after the sidecar read its list is not in that beat: give every
    attempt two beats, and a second, before its absence means its process is gone."""
    return 2 * heartbeat_interval_s + 1.0
