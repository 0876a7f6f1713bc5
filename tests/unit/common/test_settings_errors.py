"""A bad setting stops a process with an error naming the setting and the reason, never
its value: a database URL holds a password, and the error goes to a terminal or a log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "s3cretPW"


@pytest.mark.parametrize(
    ("command", "url"),
    [
        # not PostgreSQL: pydantic printed the input, the URL whole
        (["services.core"], f"mysql://alice:{PASSWORD}@db:3306/cairn"),
        # an unencoded "/", "," and ":" in the password: a piece of it read as a port
        (["services.core"], f"postgresql://alice:1,h:{PASSWORD}/x@db/cairn"),
        # the CLI's settings (cairn migrate), read from the environment too
        (["cairn", "migrate"], f"mysql://alice:{PASSWORD}@db:3306/cairn"),
    ],
)
def test_a_bad_database_url_is_named_and_its_password_is_not_shown(
    tmp_path: Path, command: list[str], url: str
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_CONFIG": str(tmp_path / "config.toml"),
        "CAIRN_DATABASE_URL": url,
    }
    done = subprocess.run(
        [sys.executable, "-m", *command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "database_url" in done.stderr
    assert "Value error" in done.stderr  # and the reason
    assert PASSWORD not in done.stdout + done.stderr
    assert not (tmp_path / "home").exists()  # stopped before it made anything
