"""``cairn login``'s tokens in the config file: written 0600 beside what the file held,
read back, refreshed only when the ID token is about to expire, and forgotten."""

from __future__ import annotations

import stat
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cairn import config
from libs.common import signin

PROVIDER = signin.Provider("https://idp.test", "", "https://idp.test/token", None, None)


@pytest.fixture
def conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cairn" / "config.toml"
    monkeypatch.setenv("CAIRN_CONFIG", str(path))
    return path


def test_the_tokens_are_kept_0600_beside_the_rest_of_the_file(conf: Path) -> None:
    conf.parent.mkdir()
    conf.write_text('url = "https://cairn.test"\ncron_url = "https://cron.test"\n')
    conf.chmod(0o644)
    later = datetime.now(UTC) + timedelta(hours=1)
    config.save_login(
        "https://idp.test", "cairn", PROVIDER, signin.Tokens('id"\\x', "refresh", later)
    )
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    kept = tomllib.loads(conf.read_text())
    assert kept["url"] == "https://cairn.test" and kept["cron_url"] == "https://cron.test"
    assert kept["login"]["id_token"] == 'id"\\x' and kept["login"]["refresh_token"] == "refresh"
    # A token with an hour left is sent as it is: no call to the provider.
    assert config.login_token() == 'id"\\x'
    assert config.load().url == "https://cairn.test"  # the [login] table is no setting
    assert config.forget_login() is not None
    assert tomllib.loads(conf.read_text()) == {
        "url": "https://cairn.test",
        "cron_url": "https://cron.test",
    }
    assert config.login_token() is None and config.forget_login() is None


def test_an_ended_sign_in_without_a_refresh_token_sends_nothing(
    conf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ended = datetime.now(UTC) - timedelta(seconds=1)
    config.save_login("https://idp.test", "cairn", PROVIDER, signin.Tokens("id", None, ended))
    assert config.login_token() is None
    assert "run `cairn login`" in capsys.readouterr().err
