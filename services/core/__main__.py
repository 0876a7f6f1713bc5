"""``python -m services.core``: run core's HTTP API and background loops."""

from __future__ import annotations

from typing import Any

from libs.common import serve
from services.core import migrate
from services.core.app import create_app
from services.core.settings import CoreSettings


def from_environment() -> Any:
    """A worker process's app when ``CAIRN_CORE_WORKERS`` is above 1."""
    return serve.app_from_environment("core", CoreSettings, create_app, freeze=True)


def main(argv: list[str] | None = None) -> None:
    serve.main(
        name="core",
        description=__doc__,
        settings_class=CoreSettings,
        create_app=create_app,
        upgrade=migrate.upgrade,
        check=migrate.check,
        argv=argv,
        graceful_s=5,
        freeze=True,
        factory="services.core.__main__:from_environment",
    )


if __name__ == "__main__":
    main()
