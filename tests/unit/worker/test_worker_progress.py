"""The agent's side of progress and checkpoints: what it takes from an attempt's files,
what it refuses (over the bound, not JSON, a fraction outside 0..1, a link), how two
unsent notes merge, and when an attempt has stalled."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from libs.common.models import MAX_CHECKPOINT_BYTES, Assignment, ProgressNote
from services.worker import progress
from services.worker.progress import CHECKPOINT_OUT_FILE, PROGRESS_FILE, Watch


def _assignment(**extra: object) -> Assignment:
    return Assignment.model_validate(
        {
            "attempt_id": 7,
            "attempt_number": 2,
            "task_id": 3,
            "kind": "task",
            "artifact": {"uri": "file:///bin/sh", "sha256": "0" * 64},
            "args": [],
            "env": {},
            "input_path": None,
            "output_path": None,
            "resources": {"cpu": 1, "memory_mb": 64},
            "timeout_s": None,
            **extra,
        }
    )


def test_the_environment_names_the_files_and_the_token(tmp_path: Path) -> None:
    plain = progress.with_paths({"A": "1"}, tmp_path, _assignment(), "http://core:8400/")
    assert plain == {
        "A": "1",
        "CAIRN_PROGRESS": str(tmp_path / PROGRESS_FILE),
        "CAIRN_CHECKPOINT_OUT": str(tmp_path / CHECKPOINT_OUT_FILE),
    }
    token = "7.2." + "a" * 32
    full = progress.with_paths(
        {}, tmp_path, _assignment(checkpoint="eA==", fencing_token=token), "http://core:8400/"
    )
    assert full["CAIRN_CHECKPOINT"] == str(tmp_path / progress.CHECKPOINT_FILE)
    assert full["CAIRN_FENCING_TOKEN"] == token
    assert full["CAIRN_FENCING_URL"] == "http://core:8400/v1/fencing"


def test_the_previous_checkpoint_is_placed_for_the_attempt_alone(tmp_path: Path) -> None:
    (tmp_path / progress.CHECKPOINT_FILE).write_bytes(b"stale")
    progress.place_checkpoint(tmp_path, b"\x00\x01state", None)
    placed = tmp_path / progress.CHECKPOINT_FILE
    assert placed.read_bytes() == b"\x00\x01state"
    assert placed.stat().st_mode & 0o777 == 0o400


def test_a_watch_sends_only_what_changed(tmp_path: Path) -> None:
    watch = Watch(tmp_path, changed_at=0.0, stall_s=5.0)
    assert watch.look(7, 1.0) == (None, [])
    (tmp_path / PROGRESS_FILE).write_text('{"fraction": 0.5, "message": "half\\u001b[2J way"}')
    note, problems = watch.look(7, 2.0)
    assert problems == [] and note is not None
    assert (note.progress, note.fraction, note.message, note.checkpoint) == (
        True,
        0.5,
        "half [2J way",  # control characters made spaces
        None,
    )
    assert watch.look(7, 3.0) == (None, [])  # the same file: nothing new
    (tmp_path / CHECKPOINT_OUT_FILE).write_bytes(b"ck")
    note, _ = watch.look(7, 4.0)
    assert (
        note is not None
        and not note.progress
        and note.checkpoint == base64.b64encode(b"ck").decode()
    )
    assert not watch.stalled(9.0) and watch.stalled(9.5)


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        (PROGRESS_FILE, b"not json", "CAIRN_PROGRESS: not JSON"),
        (PROGRESS_FILE, b"[0.5]", "CAIRN_PROGRESS: not a JSON object"),
        (PROGRESS_FILE, b'{"fraction": 1.5}', "fraction must be a number from 0 to 1"),
        (PROGRESS_FILE, b'{"fraction": true}', "fraction must be a number from 0 to 1"),
        (PROGRESS_FILE, b'{"message": 3}', "message must be a string"),
        (PROGRESS_FILE, b" " * 4097, "CAIRN_PROGRESS: larger than 4096 bytes"),
        (PROGRESS_FILE, b'{"message": "a\\ud800"}', "message holds an unpaired surrogate"),
        (PROGRESS_FILE, b"[" * 2048 + b"]" * 2048, "nested deeper than the agent parses"),
        (
            CHECKPOINT_OUT_FILE,
            b"x" * (MAX_CHECKPOINT_BYTES + 1),
            f"CAIRN_CHECKPOINT_OUT: larger than {MAX_CHECKPOINT_BYTES} bytes",
        ),
    ],
)
def test_what_cannot_be_taken_is_said_and_not_sent(
    tmp_path: Path, name: str, content: bytes, reason: str
) -> None:
    (tmp_path / name).write_bytes(content)
    note, problems = Watch(tmp_path, changed_at=0.0).look(7, 1.0)
    assert note is None and len(problems) == 1 and reason in problems[0]


def test_a_link_in_place_of_a_file_is_refused_unread(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere"
    secret.write_text('{"fraction": 0.9}')
    os.symlink(secret, tmp_path / PROGRESS_FILE)
    note, problems = Watch(tmp_path, changed_at=0.0).look(7, 1.0)
    assert note is None and "cannot be opened" in problems[0]


def test_a_full_checkpoint_is_taken(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT_OUT_FILE).write_bytes(b"y" * MAX_CHECKPOINT_BYTES)
    note, problems = Watch(tmp_path, changed_at=0.0).look(7, 1.0)
    assert problems == [] and note is not None and note.checkpoint is not None
    assert len(base64.b64decode(note.checkpoint)) == MAX_CHECKPOINT_BYTES


def test_two_unsent_notes_merge_into_the_newest_of_each() -> None:
    first = ProgressNote(attempt_id=7, fraction=0.1, message="a", checkpoint="eA==")
    second = ProgressNote(attempt_id=7, progress=False, checkpoint=None)
    third = ProgressNote(attempt_id=7, fraction=0.3, message=None)
    merged = progress.merge(progress.merge(first, second), third)
    assert (merged.progress, merged.fraction, merged.message, merged.checkpoint) == (
        True,
        0.3,
        None,
        "eA==",
    )
    only_checkpoint = progress.merge(
        first, ProgressNote(attempt_id=7, progress=False, checkpoint="eQ==")
    )
    assert (only_checkpoint.fraction, only_checkpoint.message) == (0.1, "a")
    assert only_checkpoint.checkpoint == "eQ=="
