"""A lease as the worker gets it, built from the claim's row (``db.attempts._assignments``):
validated when the row meets today's bounds, and sent as it is when it was stored under
looser ones (an older release's), never refused; a claim's equal artifacts, requests and
charges validated once, shared by its leases."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from services.core.db.attempts import _assignments


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
    [lease] = _assignments([_row()])
    assert lease.env == {"A": "1"}  # a secret reference is the claim's to fill in
    assert lease.resources.cpu == 0.5 and lease.charge is not None
    assert lease.checkpoint == "Y3A="
    assert lease.fencing_token == f"11.2.{'f' * 32}"
    assert lease.model_fields_set >= {"artifact", "resources", "charge", "fencing_token"}


def test_a_row_stored_under_looser_bounds_goes_out_as_it_is() -> None:
    [lease] = _assignments([_row(cpu=4096.0, artifact_sha256="A" * 64)])
    assert lease.resources.cpu == 4096.0
    assert lease.artifact.sha256 == "A" * 64
    assert '"resources":{"cpu":4096.0,"memory_mb":64' in lease.model_dump_json()


def test_a_claims_equal_parts_are_one_model_and_unequal_ones_their_own() -> None:
    rows = [
        _row(),
        _row(id=8, attempt_id=12),
        _row(id=9, attempt_id=13, cpu=1.0, charge_cpu=1.0),
        _row(id=10, attempt_id=14, devices={"gpu": 1}, charge_devices={"gpu": 1}),
    ]
    a, b, c, d = _assignments(rows)
    assert a.artifact is b.artifact is c.artifact is d.artifact
    assert a.resources is b.resources and a.charge is b.charge
    assert c.resources is not a.resources and c.resources.cpu == 1.0 and c.charge.cpu == 1.0
    assert d.resources.devices == {"gpu": 1} and d.charge.devices == {"gpu": 1}
    assert d.resources is not a.resources and d.charge is not a.charge
    # each lease as it would be alone
    for lease, row in zip((a, b, c, d), rows, strict=True):
        [alone] = _assignments([row])
        assert lease.model_dump_json() == alone.model_dump_json()


def test_a_looser_row_beside_valid_ones_goes_out_as_it_is_and_theirs_are_validated() -> None:
    valid, loose, after = _assignments(
        [_row(), _row(id=8, attempt_id=12, cpu=4096.0), _row(id=9, attempt_id=13)]
    )
    # the looser row's artifact is the valid rows' (shared); its request goes out as stored
    assert loose.resources.cpu == 4096.0 and loose.artifact is valid.artifact
    assert valid.resources.cpu == 0.5 and after.resources is valid.resources
    assert '"resources":{"cpu":4096.0,"memory_mb":64' in loose.model_dump_json()
    bad_artifact = _assignments([_row(artifact_sha256="A" * 64), _row(id=8, attempt_id=12)])
    assert bad_artifact[0].artifact.sha256 == "A" * 64
    assert bad_artifact[1].artifact.sha256 == "0" * 64
