"""``python -m services.core``: run core's HTTP API and background loops."""

from __future__ import annotations

from libs.common import serve
from services.core import migrate
from services.core.app import create_app
from services.core.settings import CoreSettings


def main(argv: list[str] | None = None) -> None:
    serve.main(
        name="core",
        description=__doc__,
        settings_class=CoreSettings,
        create_app=create_app,
        upgrade=migrate.upgrade,
        argv=argv,
        graceful_s=5,
        freeze=True,
    )


if __name__ == "__main__":
    main()
