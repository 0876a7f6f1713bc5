"""``python -m services.core``: run core's HTTP API and background loops."""

from __future__ import annotations

import argparse
import gc

import uvicorn

from libs.common import logs
from libs.common.embedded import database_url
from services.core import migrate
from services.core.app import create_app
from services.core.settings import CoreSettings


def serve(settings: CoreSettings) -> None:
    """Migrate (unless told not to) and serve until SIGINT/SIGTERM."""
    logs.setup("core", settings.log_level)
    url = database_url(settings.home, settings.database_url)
    if settings.migrate_on_start:
        migrate.upgrade(url)
    app = create_app(settings, url)
    # Requests allocate many short-lived objects: collect the young generation far less
    # often, and keep what start-up built out of every collection.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    uvicorn.run(
        app,
        host=settings.bind_host,
        port=settings.core_port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn logs through the root handler: JSON like the rest
        access_log=False,
        loop="uvloop",
        http="httptools",
        timeout_graceful_shutdown=5,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cairn core", description=__doc__)
    parser.add_argument("--port", type=int, help="listening port (CAIRN_CORE_PORT)")
    parser.add_argument("--host", help="listening address (CAIRN_BIND_HOST)")
    args = parser.parse_args(argv)
    overrides = {
        k: v for k, v in {"core_port": args.port, "bind_host": args.host}.items() if v is not None
    }
    serve(CoreSettings(**overrides))


if __name__ == "__main__":
    main()
