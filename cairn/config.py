"""Where the CLI finds the services and its token.

Flags first, then the environment (``CAIRN_URL``, ``CAIRN_TOKEN``, ``CAIRN_CRON_URL``,
``CAIRN_DAG_URL``), then a TOML config file (``$CAIRN_CONFIG``, default
``~/.config/cairn/config.toml``) with the same names in lower case::

    url = "https://cairn.example.com"
    cron_url = "https://cairn-cron.example.com"
    dag_url = "https://cairn-dag.example.com"
    token = "cairn_..."

With no token anywhere, the admin token `cairn up` keeps in ``$CAIRN_HOME/admin-token``
is used, so a local system works with no set-up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from libs.common.settings import CairnSettings


def config_path() -> Path:
    configured = os.environ.get("CAIRN_CONFIG")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".config" / "cairn" / "config.toml"


class ClientSettings(CairnSettings):
    """The settings of the CLI: ``CairnSettings`` read from flags, environment, file."""

    model_config = SettingsConfigDict(env_prefix="CAIRN_", extra="ignore", frozen=True)

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
        """The token to send: configured, or the local admin token of `cairn up`."""
        if self.token:
            return self.token
        local = self.home / "admin-token"
        try:
            return local.read_text().strip() or None
        except OSError:
            return None


def load(**flags: Any) -> ClientSettings:
    """The CLI's settings, with the flags given (None means not given)."""
    return ClientSettings(**{k: v for k, v in flags.items() if v is not None})
