"""``python -m services.cron``: run the cron service (API and engine)."""

from __future__ import annotations

import argparse

import uvicorn

from libs.common import logs
from libs.common.embedded import database_url
from services.cron import migrate
from services.cron.app import create_app
from services.cron.settings import CronSettings


def serve(settings: CronSettings) -> None:
    """Migrate (unless told not to) and serve until SIGINT/SIGTERM."""
    logs.setup("cron", settings.log_level)
    url = database_url(settings.home, settings.database_url)
    if settings.migrate_on_start:
        migrate.upgrade(url)
    uvicorn.run(
        create_app(settings, url),
        host=settings.bind_host,
        port=settings.cron_port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn logs through the root handler: JSON like the rest
        access_log=False,
        loop="uvloop",
        http="httptools",
        timeout_graceful_shutdown=1,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cairn cron", description=__doc__)
    parser.add_argument("--port", type=int, help="listening port (CAIRN_CRON_PORT)")
    parser.add_argument("--host", help="listening address (CAIRN_BIND_HOST)")
    args = parser.parse_args(argv)
    overrides = {
        k: v for k, v in {"cron_port": args.port, "bind_host": args.host}.items() if v is not None
    }
    serve(CronSettings(**overrides))


if __name__ == "__main__":
    main()
