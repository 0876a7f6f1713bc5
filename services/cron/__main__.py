"""``python -m services.cron``: run the cron service (API and engine)."""

from __future__ import annotations

from libs.common import serve
from services.cron import migrate
from services.cron.app import create_app
from services.cron.settings import CronSettings


def main(argv: list[str] | None = None) -> None:
    serve.main(
        name="cron",
        description=__doc__,
        settings_class=CronSettings,
        create_app=create_app,
        upgrade=migrate.upgrade,
        check=migrate.check,
        argv=argv,
        graceful_s=1,
    )


if __name__ == "__main__":
    main()
