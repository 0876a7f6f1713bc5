"""How every service process starts: its flags, logging, migrations, then uvicorn until
SIGINT/SIGTERM. Each service's ``__main__`` names its parts and calls ``main``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import uvicorn
from pydantic.warnings import UnsupportedFieldAttributeWarning
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from libs.common import logs, procs, tracing
from libs.common.corked import Corked
from libs.common.embedded import database_url
from libs.common.settings import CairnSettings, load

S = TypeVar("S", bound=CairnSettings)


def main(
    *,
    name: str,
    description: str | None,
    settings_class: type[S],
    create_app: Callable[[S, str], Any],
    upgrade: Callable[[str], None],
    check: Callable[[str], None],
    argv: list[str] | None = None,
    graceful_s: int = 5,
    freeze: bool = False,
    factory: str | None = None,
) -> None:
    """Run the service ``name`` (``core``, ``cron``, ``dag``): ``--port`` and ``--host``
    override ``CAIRN_<NAME>_PORT`` and ``CAIRN_BIND_HOST``. With ``factory`` (the import
    string of a ``from_environment`` built on ``app_from_environment``) and a setting
    ``<name>_workers`` above 1, that many worker processes serve the port, each with its
    own app, pools and loops, as replicas do."""
    parser = argparse.ArgumentParser(prog=f"cairn {name}", description=description)
    parser.add_argument("--port", type=int, help=f"listening port (CAIRN_{name.upper()}_PORT)")
    parser.add_argument("--host", help="listening address (CAIRN_BIND_HOST)")
    args = parser.parse_args(argv)
    quiet_fastapi_aliases()
    port_field = f"{name}_port"
    overrides = {
        k: v for k, v in {port_field: args.port, "bind_host": args.host}.items() if v is not None
    }
    settings = load(settings_class, f"cairn {name}", **overrides)
    logs.setup(name, settings.log_level)
    tracing.setup(name)
    url = database_url(settings.home, settings.database_url)
    # either needs a session (the migrations' advisory lock; the version table's schema)
    migrating = getattr(settings, "migrate_on_start", True)
    _migrate(name, upgrade if migrating else check, settings.direct_url(url))
    workers = int(getattr(settings, f"{name}_workers", 1))
    options: dict[str, Any] = {
        "host": settings.bind_host,
        "port": getattr(settings, port_field),
        "log_level": settings.log_level,
        "log_config": None,  # uvicorn logs through the root handler: JSON like the rest
        "access_log": False,
        "loop": "uvloop",
        "http": CorkedHttpTools,  # a response in one write, not its head and body apart
        "timeout_graceful_shutdown": graceful_s,
    }
    if factory is not None and workers > 1:
        # Each worker process builds its app from the environment: say what was decided.
        os.environ[f"CAIRN_{name.upper()}_PORT"] = str(options["port"])
        os.environ["CAIRN_BIND_HOST"] = settings.bind_host
        os.environ["CAIRN_DATABASE_URL"] = url
        uvicorn.run(factory, factory=True, workers=workers, **options)
        return
    app = create_app(settings, url)
    if freeze:
        procs.settle_collector()
    _Server(uvicorn.Config(app, **options), app).run()


def _migrate(name: str, upgrade: Callable[[str], None], url: str) -> None:
    """``upgrade(url)`` (or ``check(url)``: the schema is this release's or newer); when a
    migration gives up behind a blocker, its server is lost or unreachable, or the schema
    is behind, its message (whom it waited for, what to do; which server and what error)
    as one log line and exit status 1, as ``cairn migrate``."""
    from libs.common.migrations import MigrationFailed  # alembic: only when migrating

    try:
        upgrade(url)
    except MigrationFailed as blocked:
        logging.getLogger(f"cairn.{name}").error("%s did not start: %s", name, blocked)
        raise SystemExit(1) from None


class CorkedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol writing each response (its head and its body, written
    in one pass of the loop) in one system call (``corked``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = Corked(transport)  # type: ignore[assignment]


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT/SIGTERM also runs the app's ``state.on_exit``
    hooks (on its loop) before it waits for the requests in flight: a service whose
    long polls would hold the shutdown answers them at once."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        state = getattr(self._app, "state", None)
        for hook in getattr(state, "on_exit", ()):
            try:
                asyncio.get_running_loop().call_soon_threadsafe(hook)
            except RuntimeError:
                hook()


def app_from_environment(
    name: str, settings_class: type[S], create_app: Callable[[S, str], Any], freeze: bool
) -> Any:
    """A worker process's app, from the environment ``main`` set (migrated already)."""
    quiet_fastapi_aliases()
    settings = load(settings_class, f"cairn {name}")
    logs.setup(name, settings.log_level)
    tracing.setup(name)
    app = create_app(settings, database_url(settings.home, settings.database_url))
    if freeze:
        procs.settle_collector()
    return app


def quiet_fastapi_aliases() -> None:
    """Silence pydantic's false alarm about FastAPI's request parameters: FastAPI gives
    each body parameter a ``Field`` with an alias (the parameter's name) and applies the
    alias itself, and pydantic 2.12 and later warns, at the first request of each route
    and again for the OpenAPI document, that such an alias "has no effect" (pydantic
    issue 12356; FastAPI silences it for headers only). A service printed one for each
    of its routes with a body. Only this message about an alias is silenced."""
    warnings.filterwarnings(
        "ignore",
        message=r"The '(validation_|serialization_)?alias' attribute with value .* was provided "
        r"to the `Field\(\)` function",
        category=UnsupportedFieldAttributeWarning,
    )
