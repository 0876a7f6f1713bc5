"""Settings every Cairn process reads: environment first (``CAIRN_*``), flags override."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from libs.common.sources import redact_url

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
#: seconds a connection to one host of several may take before the next is tried (libpq's
#: ``connect_timeout``), unless the URL says otherwise: without it psycopg gives each host
#: 130 s, so a primary that died with its host would hold up every new connection
MULTI_HOST_CONNECT_TIMEOUT_S = 5


def normalise_database_url(url: str) -> str:
    """Return ``url`` with the SQLAlchemy psycopg 3 driver named explicitly, and several
    hosts (a PostgreSQL cluster that fails over) in the one form that SQLAlchemy and libpq
    both read: ``postgresql+psycopg://user@/db?host=h1,h2&port=p1,p2``. libpq's own
    ``user@h1:p1,h2:p2/db`` and SQLAlchemy's ``?host=h1:p1&host=h2:p2`` are accepted.
    Several hosts get a ``connect_timeout`` (:data:`MULTI_HOST_CONNECT_TIMEOUT_S`) unless
    the URL sets one."""
    for prefix in ("postgres://", "postgresql://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
            break
    if not url.startswith("postgresql+psycopg://"):
        raise ValueError("must be a PostgreSQL URL (postgresql://...)")
    if _RAW_PERCENT.search(url):
        # libpq refuses such a URL at every connection, quoting the token (the password)
        # in its error; SQLAlchemy reads it as it is. Refused here, the token unquoted.
        raise ValueError(
            "has a '%' not followed by two hex digits: in a URL a '%' in the user name"
            " or password must be percent-encoded as %25 (and '@', ':', '/' as %40, %3A, %2F)"
        )
    return _hosts_in_query(url)


#: a ``%`` that does not start a percent-encoded byte (RFC 3986, 2.1)
_RAW_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def libpq_url(url: str) -> str:
    """The same URL as plain libpq understands it (no SQLAlchemy driver suffix)."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def database_hosts(url: str) -> list[tuple[str, int | None]]:
    """Every (host, port) a normalised database URL names, in order (one for most URLs;
    a Unix socket's folder is a host too), as libpq reads them."""
    from psycopg.conninfo import conninfo_to_dict  # psycopg is not loaded by the CLI

    info = conninfo_to_dict(libpq_url(url))
    names = str(info.get("host") or "").split(",")
    numbers = str(info.get("port") or "").split(",")
    if len(numbers) == 1:
        numbers *= len(names)
    return [(h, int(p) if p else None) for h, p in zip(names, numbers, strict=True)]


def _hosts_in_query(url: str) -> str:
    scheme, netloc, path, query, fragment = urlsplit(url)
    user, at, hostlist = netloc.rpartition("@")
    items = query.split("&") if query else []
    keys = {i.partition("=")[0] for i in items}
    given = [unquote(i.partition("=")[2]) for i in items if i.partition("=")[0] == "host"]
    if given and hostlist:
        raise ValueError("name the hosts either in the URL's authority or in ?host=, not both")
    if len(given) > 1 or any(_HOST_PORT.match(h) for v in given for h in v.split(",")):
        if "port" in keys:
            raise ValueError("name the ports either as ?host=h:p or in ?port=, not both")
        pairs = [_host_port(item) for value in given for item in value.split(",")]
    elif "," in hostlist:
        pairs = [_host_port(item) for item in hostlist.split(",")]
    else:  # one host, or several already in the one form
        # its port a number: libpq's int() of it was a traceback at the first connection
        _host_port(hostlist)
        several = bool(given) and "," in given[0]
        return url + _timeout(items) if several and "connect_timeout" not in keys else url
    rest = [i for i in items if i.partition("=")[0] not in ("host", "port")]
    hosts = ",".join(quote(h, safe=":/") for h, _ in pairs)
    ports = ",".join(p for _, p in pairs)
    located = [f"host={hosts}", *([f"port={ports}"] if ports.strip(",") else []), *rest]
    query = "&".join(located)
    if len(pairs) > 1 and "connect_timeout" not in keys:
        query += _timeout(located)
    return urlunsplit((scheme, user + at, path, query, fragment))


def _timeout(items: list[str]) -> str:
    return f"{'&' if items else '?'}connect_timeout={MULTI_HOST_CONNECT_TIMEOUT_S}"


#: SQLAlchemy's ``?host=h:p`` (a name or IPv4 address, or a bracketed IPv6 one, and a port)
_HOST_PORT = re.compile(r"^([A-Za-z0-9.-]*|\[[0-9A-Fa-f:.%]*\]):\d*$")


def _host_port(item: str) -> tuple[str, str]:
    """``h:p``, ``[v6]:p``, ``h`` as (host, port text)."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = item.partition(":")
    if port and not port.isdigit():
        # not the text itself: in a URL whose password holds an unencoded "/", "," or
        # ":", what was read as a host and port is a piece of the password
        raise ValueError("a host's port is not a number")
    return unquote(host), port


def is_http_url(text: str) -> bool:
    """Whether ``text`` is an http(s) URL with a host (and a port, if any, a number): one
    httpx can send to."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018  (raises ValueError when not a port)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _http_url(value: str) -> str:
    if not is_http_url(value):
        # shown without its credentials: the error reaches a terminal or a log
        raise ValueError(
            f"{redact_url(value)!r} is not an http(s) URL with a host (http://host:port)"
        )
    return value


#: a service's URL (``CAIRN_URL``, ``CAIRN_CRON_URL``, ``CAIRN_DAG_URL``): refused at
#: start when httpx cannot send to it (no scheme, no host), which every call met later,
#: a worker retrying its registration for ever ("core not reachable yet")
HttpUrl = Annotated[str, AfterValidator(_http_url)]

#: the levels ``logging`` and uvicorn both know, in the lower case uvicorn looks them up in
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _log_level(value: str) -> str:
    level = value.strip().lower()
    if level not in _LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(_LOG_LEVELS)}")
    return level


#: ``CAIRN_LOG_LEVEL``: any case; another word was a traceback from ``logging`` at start
LogLevel = Annotated[str, AfterValidator(_log_level)]


def _given(value: object) -> object:
    if isinstance(value, str) and not value.strip():
        raise ValueError("is empty: unset it for the default (~/.cairn), or name a folder")
    return value


def _expand(value: Path) -> Path:
    return value.expanduser().absolute()


#: ``CAIRN_HOME``, made absolute; empty is refused: it was read as the working folder, where
#: the embedded database, tokens and secrets key were then made
HomePath = Annotated[Path, BeforeValidator(_given), AfterValidator(_expand)]


class CairnBaseSettings(BaseSettings):
    """What every Cairn settings class shares: ``CAIRN_*`` variables, the others ignored,
    frozen once read. A bad value's error names the setting and the reason, never the
    value (``hide_input_in_errors``): a database URL holds a password, and the error
    goes to a terminal, a log or a CI page. No number is infinite or NaN
    (``allow_inf_nan``): ``inf`` passed every bound ``gt=0`` and reached a sleep, a
    deadline or a JSON answer (which has no such number). A subclass's own
    ``model_config`` is merged with this one. Processes read them with :func:`load`."""

    model_config = SettingsConfigDict(
        env_prefix="CAIRN_",
        extra="ignore",
        frozen=True,
        hide_input_in_errors=True,
        allow_inf_nan=False,
    )


S = TypeVar("S", bound=CairnBaseSettings)


def load(settings_class: type[S], program: str, **overrides: Any) -> S:
    """``settings_class`` from the environment (and ``overrides``, the flags given); a bad
    value stops the process before it does anything, with one line on stderr naming each
    variable and the reason, and exit status 1: pydantic's own error was a traceback of
    twenty lines that named the field (``heartbeat_interval_s``), not the variable."""
    try:
        return settings_class(**overrides)
    except ValidationError as exc:
        raise SystemExit(f"{program}: bad settings: {settings_problems(exc)}") from None


def settings_problems(exc: ValidationError) -> str:
    """A settings class's refusal as one line: ``CAIRN_NAME: reason; ...`` (a rule across
    several settings names them in its reason)."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        field = error["loc"][0] if error["loc"] else None
        name = f"CAIRN_{str(field).upper()}: " if field is not None else ""
        problems.append(name + " ".join(error["msg"].split()))
    return "; ".join(problems)


class WorkerOfferSettings(CairnBaseSettings):
    """What a worker offers core (``CAIRN_WORKER_*``): read by the worker agent, and by
    ``cairn up`` for the worker it starts."""

    worker_queues: str = "default"
    worker_cpu: float = Field(default_factory=lambda: float(os.cpu_count() or 1), gt=0)
    worker_memory_mb: int = Field(default_factory=lambda: host_memory_mb(), gt=0)
    worker_labels: str = ""
    #: the countable devices the worker offers, by name: ``gpu=2,fpga=1``
    #: (docs/placement.md, "Devices")
    worker_devices: str = ""
    worker_drain_grace_s: float = Field(default=60.0, ge=0)
    worker_slots: int = Field(default=64, ge=1, le=4096)


class MigrationSettings(CairnBaseSettings):
    """How a migration run waits for its locks (``CAIRN_MIGRATION_*``): read by every
    service's ``migrate.upgrade`` (the setup job, ``cairn migrate``/``up``, a service's
    start). A statement waits at most ``lock_timeout_s`` for a lock (a long transaction
    holding one on a hot table would otherwise queue every later query behind the
    migration's request), then the run rolls back what it had not finished and tries
    again after a backoff, ``lock_attempts`` times in all. An index built concurrently
    blocks no query while it waits for the transactions older than it: it waits up to
    ``index_wait_s`` for each, and is not tried again (docs/deploy.md)."""

    migration_lock_timeout_s: float = Field(default=5.0, gt=0, le=600)
    migration_lock_attempts: int = Field(default=6, ge=1, le=100)
    #: the first backoff; each next one doubles, up to 60 s
    migration_lock_backoff_s: float = Field(default=5.0, ge=0, le=60)
    migration_index_wait_s: float = Field(default=1800.0, gt=0, le=86400)


class CairnSettings(WorkerOfferSettings):
    """The settings shared by every process; names and defaults are part of the interface."""

    env: Literal["development", "production"] = "development"
    home: HomePath = Field(default_factory=lambda: Path.home() / ".cairn")
    database_url: str | None = None
    # Sessions a transaction pooler cannot carry (LISTEN, session advisory locks,
    # migrations) connect here; unset, the same as database_url.
    database_direct_url: str | None = None
    # "transaction": database_url passes a transaction pooler (no server-side prepared
    # statements); unset, it does when a direct URL other than database_url is given.
    database_pooler: Literal["transaction", "none"] | None = None
    url: HttpUrl = "http://127.0.0.1:8400"
    # Core's replicas, comma-separated, for the cron and DAG services' calls and token
    # checks: one that cannot be reached passes a call to the next (``ApiClient``);
    # unset, ``url`` alone.
    core_urls: str = ""
    token: str | None = None
    #: an address or host name; empty is refused: uvicorn read it as every address, IPv4
    #: and IPv6 (``0.0.0.0`` or ``::`` say so on purpose)
    bind_host: str = Field(default="127.0.0.1", pattern=r"^\S+$")
    core_port: int = Field(default=8400, ge=1, le=65535)
    cron_port: int = Field(default=8401, ge=1, le=65535)
    dag_port: int = Field(default=8402, ge=1, le=65535)
    dag_url: HttpUrl = "http://127.0.0.1:8402"
    cron_url: HttpUrl = "http://127.0.0.1:8401"
    ui_origins: str = ""
    heartbeat_interval_s: float = Field(default=60.0, gt=0)
    heartbeat_timeout_s: float = Field(default=180.0, gt=0)
    # An agent whose loop has not turned for this long is hung: its sidecar kills its
    # attempts at half of it, core declares the worker dead at the whole (docs/architecture.md).
    agent_hang_timeout_s: float = Field(default=300.0, gt=0)
    log_level: LogLevel = "info"
    # The system user the embedded PostgreSQL runs as when Cairn runs as root.
    pg_system_user: str = Field(default="embedded_postgres", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")

    @field_validator("database_url", "database_direct_url")
    @classmethod
    def _normalise_url(cls, value: str | None) -> str | None:
        return normalise_database_url(value) if value else None

    @field_validator("core_urls")
    @classmethod
    def _check_core_urls(cls, value: str) -> str:
        # Refused at start, naming the setting: a URL httpx cannot send to (no scheme, a
        # space for a comma) failed every call to it later, a GET passing to the next
        # replica and a POST or a lone URL failing (UnsupportedProtocol, a 503 per check)
        items = parse_list(value)
        for number, item in enumerate(items, 1):
            if not is_http_url(item):
                # shown without its credentials: the error reaches a terminal or a log
                raise ValueError(
                    f"CAIRN_CORE_URLS: {redact_url(item)!r} (URL {number} of {len(items)})"
                    " is not an http(s) URL with a host (http://host:port), the URLs"
                    " separated by commas"
                )
        return value

    @model_validator(mode="after")
    def _refuse_insecure_production(self) -> CairnSettings:
        if self.env == "production" and self.database_url is None:
            raise ValueError("CAIRN_DATABASE_URL is required when CAIRN_ENV=production")
        return self

    @model_validator(mode="after")
    def _check_heartbeat(self) -> CairnSettings:
        # A worker beats every interval and is declared dead after the timeout's silence:
        # a timeout not above the interval buried every healthy worker between two beats,
        # re-placing its attempts, and again after each registration.
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "CAIRN_HEARTBEAT_TIMEOUT_S must be above CAIRN_HEARTBEAT_INTERVAL_S (a worker"
                " beats every interval and is declared dead after the timeout's silence;"
                " keep it two or three intervals)"
            )
        return self

    @model_validator(mode="after")
    def _refuse_pooler_without_direct(self) -> CairnSettings:
        if self.database_direct_url and not self.database_url:
            raise ValueError(
                "CAIRN_DATABASE_DIRECT_URL is set without CAIRN_DATABASE_URL: set both (the"
                " pooler's URL and the server's), or neither (the embedded server)"
            )
        if self.database_pooler == "transaction" and not self._direct_differs:
            raise ValueError(
                "CAIRN_DATABASE_POOLER=transaction needs CAIRN_DATABASE_DIRECT_URL, a URL"
                " straight to PostgreSQL other than CAIRN_DATABASE_URL: LISTEN/NOTIFY, the"
                " leaders' advisory locks and migrations need sessions a transaction pooler"
                " does not keep"
            )
        return self

    @property
    def _direct_differs(self) -> bool:
        direct = self.database_direct_url
        return direct is not None and direct != self.database_url

    @property
    def pooler(self) -> Literal["transaction", "none"]:
        """What ``database_url`` passes through: ``CAIRN_DATABASE_POOLER``, else a
        transaction pooler when a different direct URL is given."""
        if self.database_pooler is not None:
            return self.database_pooler
        return "transaction" if self._direct_differs else "none"

    def direct_url(self, url: str) -> str:
        """Where sessions go that must stay one server session (LISTEN, session advisory
        locks, migrations): ``CAIRN_DATABASE_DIRECT_URL``, else ``url`` (the pools')."""
        return self.database_direct_url or url

    @property
    def cores(self) -> list[str]:
        """Where cron and dag reach core: ``CAIRN_CORE_URLS``, else ``CAIRN_URL``."""
        return parse_list(self.core_urls) or [self.url]

    @property
    def labels(self) -> dict[str, str]:
        return parse_labels(self.worker_labels)

    @property
    def queues(self) -> list[str]:
        return parse_list(self.worker_queues)


def parse_labels(text: str) -> dict[str, str]:
    """``CAIRN_WORKER_LABELS`` as a map: ``zone=a,gpu=none``."""
    pairs = (item.partition("=") for item in text.split(",") if item.strip())
    return {key.strip(): value.strip() for key, _, value in pairs}


def parse_devices(text: str) -> dict[str, int]:
    """``CAIRN_WORKER_DEVICES`` as counts by name: ``gpu=2,fpga=1``."""
    out: dict[str, int] = {}
    for name, count in parse_labels(text).items():
        if not count.isdigit():
            raise ValueError(f"device {name!r}: {count!r} is not a count")
        if int(count) > 0:
            out[name] = int(count)
    return out


def parse_list(text: str) -> list[str]:
    """A comma-separated setting as its non-empty items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def host_memory_mb() -> int:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1024
    return max(1, pages * page_size // (1024 * 1024))
