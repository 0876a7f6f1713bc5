"""`cairn worker` in production, as the compose file runs it: the CLI's own settings (which
demand a database URL in production) are not read; the agent reads its own."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cairn.cli import app


def test_cairn_worker_starts_the_agent_in_production_without_a_database_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import services.worker.agent as agent

    started: list[list[str]] = []
    monkeypatch.setattr(agent, "main", lambda argv=None: started.append(list(argv or [])))
    monkeypatch.setenv("CAIRN_ENV", "production")
    monkeypatch.delenv("CAIRN_DATABASE_URL", raising=False)
    result = CliRunner().invoke(app, ["worker"])
    assert result.exit_code == 0, result.output
    assert started == [[]]


def test_other_commands_still_refuse_production_without_a_database_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CAIRN_ENV", "production")
    monkeypatch.delenv("CAIRN_DATABASE_URL", raising=False)
    result = CliRunner().invoke(app, ["migrate"])
    assert result.exit_code != 0
    assert "CAIRN_DATABASE_URL is required" in str(result.exception)
