"""A lease as the worker gets it, built from the claim's row (``db.attempts._assignment``):
validated when the row meets today's bounds, and sent as it is when it was stored under
looser ones (an older release's), never refused."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from services.core.db.attempts import _assignment


def _row(**changes: Any) -> SimpleNamespace:
    row = {
        "id": 7, "attempt_id": 11, "attempt_number": 2, "kind": "task",
        "artifact_uri": "file:///bin/true", "artifact_sha256": "0" * 64,
        "args": ["-c", "exit 0"], "env": {"A": "1", "S": {"secret": "s"}},
        "input_path": None, "output_path": None, "cpu": 0.5, "memory_mb": 64,
        "devices": None, "disk_mb": None, "timeout_s": 30, "charge_cpu": 0.5,
        "charge_memory_mb": 64.0, "charge_devices": None, "preemptible": False,
        "start_at": None, "progress_timeout_s": None, "checkpoint": b"cp", "fence": "f" * 32,
        "egress": None, "service": None, "created_at": datetime(2026, 12, 5, tzinfo=UTC),
    }  # fmt: skip
    return SimpleNamespace(**{**row, **changes})


def test_a_row_within_todays_bounds_is_validated_into_its_lease() -> None:
    lease = _assignment(_row())
    assert lease.env == {"A": "1"}  # a secret reference is the claim's to fill in
    assert lease.resources.cpu == 0.5 and lease.charge is not None
    assert lease.checkpoint == "Y3A="
    assert lease.fencing_token == f"11.2.{'f' * 32}"
    assert lease.model_fields_set >= {"artifact", "resources", "charge", "fencing_token"}


def test_a_row_stored_under_looser_bounds_goes_out_as_it_is() -> None:
    lease = _assignment(_row(cpu=4096.0, artifact_sha256="A" * 64))
    assert lease.resources.cpu == 4096.0
    assert lease.artifact.sha256 == "A" * 64
    assert '"resources":{"cpu":4096.0,"memory_mb":64' in lease.model_dump_json()
