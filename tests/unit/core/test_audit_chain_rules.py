"""The audit chain's pure rules (domain/auditchain.py) and the export's settings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.core.domain import auditchain
from services.core.ops import auditexport
from services.core.settings import CoreSettings


def _chain(count: int) -> list[bytes]:
    prev, out = auditchain.GENESIS, []
    for i in range(1, count + 1):
        row = {
            "id": i,
            "at": datetime(2026, 12, 5, 1, 0, i, tzinfo=UTC),
            "actor": "root",
            "actor_role": "admin",
            "action": "team.create",
            "target": f"team:{i}",
            "source": None,
            "before": None,
            "after": {"z": 1, "a": [1.5, "é"]},
            "prev_hash": prev,
        }
        row["hash"] = prev = auditchain.link(prev, row)
        out.append(auditchain.line(row))
    return out


def test_the_hash_covers_the_content_whatever_its_key_order_or_time_zone() -> None:
    row = {name: None for name in auditchain.FIELDS} | {"id": 1, "after": {"b": 1, "a": 2}}
    at = datetime(2026, 12, 5, 2, 0, tzinfo=timezone(timedelta(hours=1)))
    one = auditchain.link("x", row | {"at": at})
    other = auditchain.link("x", dict(reversed((row | {"at": at.astimezone(UTC)}).items())))
    assert one == other
    assert auditchain.link("y", row | {"at": at}) != one


def test_the_verifier_reports_the_first_reorder_or_garbage() -> None:
    lines = _chain(4)
    assert auditchain.verify(lines, auditchain.GENESIS).ok
    swapped = auditchain.verify([lines[0], lines[2], lines[1], lines[3]])
    assert (swapped.at_line, swapped.rows) == (2, 1)
    garbage = auditchain.verify([lines[0], b"{not json\n"])
    assert garbage.at_line == 2 and "not an audit row" in (garbage.problem or "")
    # A tail that does not start the trail fails only if the start is demanded.
    assert auditchain.verify(lines[1:]).ok
    assert not auditchain.verify(lines[1:], auditchain.GENESIS).ok


def test_the_export_destination_is_a_path_or_an_s3_url(tmp_path: Path) -> None:
    for good in ("/var/log/cairn/audit.jsonl", "s3://audit-bucket", "s3://audit-bucket/a/b"):
        assert CoreSettings(home=tmp_path, audit_export_to=good).audit_export_to == good
    for bad in ("relative.jsonl", "-", "s3://", "https://x"):
        with pytest.raises(ValidationError):
            CoreSettings(home=tmp_path, audit_export_to=bad)
    assert isinstance(auditexport.sink_for("-"), auditexport.StdoutSink)
    assert isinstance(auditexport.sink_for("/tmp/a.jsonl"), auditexport.FileSink)
    sink = auditexport.sink_for("s3://b-1/audit")
    assert isinstance(sink, auditexport.ObjectSink)
    assert sink.key(1, 20) == "audit/00000000000000000001-00000000000000000020.jsonl"
