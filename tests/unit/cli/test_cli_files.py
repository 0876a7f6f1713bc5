"""What the CLI reads from files it is pointed at is bounded: a submission or definition
file up to the largest request body, an artifact hashed only when it is a regular file."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cairn.cli import app
from cairn.tasks_cli import MAX_DOCUMENT_BYTES, sha256_of


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CliRunner:
    # Nothing listens here: a command that sent anything would fail to connect.
    for name in ("CAIRN_URL", "CAIRN_CRON_URL", "CAIRN_DAG_URL"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("CAIRN_TOKEN", "tok")
    monkeypatch.setenv("CAIRN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CAIRN_CONFIG", raising=False)
    return CliRunner()


@pytest.mark.parametrize("command", [["submit", "-f"], ["dag", "submit"]])
def test_a_file_over_the_body_limit_is_refused_unread(
    cli: CliRunner, tmp_path: Path, command: list[str]
) -> None:
    """It was read whole (``-f /dev/zero`` took 3 GB in 15 s and went on)."""
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_DOCUMENT_BYTES + 1))
    done = cli.invoke(app, [*command, str(big)])
    assert done.exit_code == 2, done.output
    assert f"is over {MAX_DOCUMENT_BYTES} bytes" in done.output


def test_only_a_regular_file_is_hashed(tmp_path: Path) -> None:
    """``file:///dev/zero`` was read without end to hash it."""
    tool = tmp_path / "tool"
    tool.write_bytes(b"#!/bin/sh\n")
    assert sha256_of(f"file://{tool}") is not None
    assert sha256_of("file:///dev/null") is None
    assert sha256_of(f"file://{tmp_path}") is None
