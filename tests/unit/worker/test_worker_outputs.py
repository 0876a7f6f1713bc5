"""The agent's side of outputs: what it reads from an attempt's ``CAIRN_OUTPUTS`` file,
and what it refuses (too large, not an object, a link, not a regular file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from libs.common.models import MAX_OUTPUTS_BYTES, Report
from services.worker import outputs


def _write(folder: Path, text: str) -> None:
    (folder / outputs.FILE).write_text(text)


def test_the_path_is_in_the_attempts_folder_and_overrides_the_tasks_env(tmp_path: Path) -> None:
    env = outputs.with_path({"A": "1", "CAIRN_OUTPUTS": "/elsewhere"}, tmp_path)
    assert env == {"A": "1", "CAIRN_OUTPUTS": str(tmp_path / outputs.FILE)}


def test_no_file_is_no_outputs_and_an_object_is_read(tmp_path: Path) -> None:
    assert outputs.read(tmp_path) is None
    _write(tmp_path, json.dumps({"path": "s3://b/k", "rows": 3, "files": ["a", "b"]}))
    assert outputs.read(tmp_path) == {"path": "s3://b/k", "rows": 3, "files": ["a", "b"]}
    report = outputs.attach(Report(outcome="succeeded", exit_code=0), tmp_path)
    assert report is not None and report.outputs == {
        "path": "s3://b/k",
        "rows": 3,
        "files": ["a", "b"],
    }


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[1, 2]", "not a JSON object"),
        ("{not json", "not a JSON object"),
        (json.dumps({"bad key": 1}), "not a JSON object"),
        (json.dumps({"x": "y" * MAX_OUTPUTS_BYTES}), "larger than"),
        ('{"x": NaN}', "no NaN"),
        ('{"x": ["a\\u0000"]}', "NUL"),
        ('{"x": ["a\\ud800"]}', "unpaired surrogate"),
        ('{"x": {"\\udfff": 1}}', "unpaired surrogate"),
        ('{"x": ' + "[" * 32 + "]" * 32 + "}", "nested deeper than 32"),
        ('{"x": ' + "[" * 3000 + "]" * 3000 + "}", "nested deeper than 32"),
        (f'{{"x": {2**63}}}', "64 bits"),
        (f'{{"x": [{-(2**63) - 1}]}}', "64 bits"),
    ],
)
def test_a_broken_file_fails_a_succeeded_attempt_for_good(
    tmp_path: Path, text: str, reason: str
) -> None:
    _write(tmp_path, text)
    report = outputs.attach(Report(outcome="succeeded", exit_code=0), tmp_path)
    assert report is not None
    assert (report.outcome, report.retryable, report.outputs) == ("failed", False, None)
    assert report.error is not None and reason in report.error


def test_the_bounds_themselves_are_taken(tmp_path: Path) -> None:
    deepest = "[" * 31 + "]" * 31  # the object is level 1: 31 arrays below it
    big, small = 2**63 - 1, -(2**63)
    _write(tmp_path, f'{{"x": {deepest}, "big": {big}, "small": {small}, "e": "\\u00e9"}}')
    found = outputs.read(tmp_path)
    assert found is not None and found["big"] == 2**63 - 1 and found["small"] == -(2**63)
    assert found["e"] == "\u00e9"


def test_a_link_is_not_followed_and_a_fifo_not_waited_on(tmp_path: Path) -> None:
    secret = tmp_path / "agent-token"
    secret.write_text(json.dumps({"token": "s3cr3t"}))
    (tmp_path / outputs.FILE).symlink_to(secret)
    with pytest.raises(outputs.OutputsError, match="cannot be opened"):
        outputs.read(tmp_path)
    (tmp_path / outputs.FILE).unlink()
    os.link(secret, tmp_path / outputs.FILE)
    with pytest.raises(outputs.OutputsError, match="not a regular file"):
        outputs.read(tmp_path)
    (tmp_path / outputs.FILE).unlink()
    os.mkfifo(tmp_path / outputs.FILE)
    with pytest.raises(outputs.OutputsError, match="not a regular file"):
        outputs.read(tmp_path)


def test_a_failed_attempt_keeps_its_report_whatever_the_file(tmp_path: Path) -> None:
    _write(tmp_path, "{broken")
    failed = Report(outcome="failed", exit_code=1)
    assert outputs.attach(failed, tmp_path) == failed
    assert outputs.attach(None, tmp_path) is None
