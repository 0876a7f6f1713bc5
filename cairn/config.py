"""Where the CLI finds the services and its token.

Flags first, then the environment (``CAIRN_URL``, ``CAIRN_TOKEN``, ``CAIRN_CRON_URL``,
``CAIRN_DAG_URL``), then a TOML config file (``$CAIRN_CONFIG``, default
``~/.config/cairn/config.toml``) with the same names in lower case::

    url = "https://cairn.example.com"
    cron_url = "https://cairn-cron.example.com"
    dag_url = "https://cairn-dag.example.com"
    token = "cairn_..."

With no token anywhere, the tokens ``cairn login`` keeps in the same file (its
``[login]`` table, the file made 0600) are used, refreshed before the ID token expires;
and with none of those, the admin token `cairn up` keeps in ``$CAIRN_HOME/admin-token``,
so a local system works with no set-up.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

from libs.common import signin
from libs.common.errors import CairnError
from libs.common.settings import CairnSettings
from libs.common.settings import load as load_settings

#: the ID token is refreshed when it has less than this left
REFRESH_AHEAD = timedelta(seconds=60)


def config_path() -> Path:
    configured = os.environ.get("CAIRN_CONFIG")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".config" / "cairn" / "config.toml"


class ClientSettings(CairnSettings):
    """The settings of the CLI: ``CairnSettings`` read from flags, environment, file."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            TomlConfigSettingsSource(settings_cls, toml_file=config_path()),
        )

    def bearer(self) -> str | None:
        """The token to send: configured, else the ID token of ``cairn login`` (refreshed
        when it is about to expire), else the local admin token of `cairn up`."""
        if self.token:
            return self.token
        signed_in = login_token()
        if signed_in is not None:
            return signed_in
        local = self.home / "admin-token"
        try:
            return local.read_text().strip() or None
        except OSError:
            return None


def load(**flags: Any) -> ClientSettings:
    """The CLI's settings, with the flags given (None means not given)."""
    return load_settings(
        ClientSettings, "cairn", **{k: v for k, v in flags.items() if v is not None}
    )


# --- the tokens of ``cairn login``, in the config file's [login] table ---------------


def _read() -> dict[str, Any]:
    try:
        with config_path().open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        return {}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    raise ValueError(f"cannot write {type(value).__name__} to the config file")


def _toml(document: dict[str, Any]) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in document.items() if not isinstance(v, dict)]
    for name, table in document.items():
        if isinstance(table, dict):
            lines += ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def _write(document: dict[str, Any]) -> None:
    """Replace the config file with ``document``, readable by its owner only (0600)."""
    path = config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(_toml(document))
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


def save_login(
    issuer: str, client_id: str, provider: signin.Provider, tokens: signin.Tokens
) -> None:
    """Keep what ``cairn login`` got (the rest of the file as it was)."""
    document = _read()
    document["login"] = {
        "issuer": issuer,
        "client_id": client_id,
        "token_endpoint": provider.token_endpoint,
        "revocation_endpoint": provider.revocation_endpoint or "",
        "id_token": tokens.id_token,
        "refresh_token": tokens.refresh_token or "",
        "expires_at": tokens.expires_at.isoformat(),
    }
    _write(document)


def saved_login() -> dict[str, Any] | None:
    found = _read().get("login")
    return found if isinstance(found, dict) and found.get("id_token") else None


def forget_login() -> dict[str, Any] | None:
    """Remove the [login] table; what it held (None: there was none)."""
    document = _read()
    gone = document.pop("login", None)
    if gone is not None:
        _write(document)
    return gone if isinstance(gone, dict) else None


def login_token(now: datetime | None = None) -> str | None:
    """The ID token of ``cairn login``; refreshed first (and kept) when it has less
    than ``REFRESH_AHEAD`` left. None when there is none or it has ended."""
    login = saved_login()
    if login is None:
        return None
    now = now or datetime.now(UTC)
    expires = datetime.fromisoformat(str(login.get("expires_at", "1970-01-01T00:00:00+00:00")))
    if expires - now > REFRESH_AHEAD:
        return str(login["id_token"])
    if login.get("refresh_token"):
        try:
            with httpx.Client(timeout=signin.TIMEOUT) as http:
                tokens = signin.refresh(
                    http, login["token_endpoint"], login["client_id"], login["refresh_token"]
                )
        except CairnError as exc:
            print(f"cairn: could not refresh the sign-in ({exc.detail})", file=sys.stderr)
        else:
            refreshed = signin.Provider(
                issuer=login["issuer"],
                authorization_endpoint="",
                token_endpoint=login["token_endpoint"],
                revocation_endpoint=login.get("revocation_endpoint") or None,
            )
            if tokens.refresh_token is None:  # the provider keeps the same one
                tokens = signin.Tokens(tokens.id_token, login["refresh_token"], tokens.expires_at)
            save_login(login["issuer"], login["client_id"], refreshed, tokens)
            return tokens.id_token
    if expires > now:
        return str(login["id_token"])
    print("cairn: your sign-in has ended: run `cairn login`", file=sys.stderr)
    return None
